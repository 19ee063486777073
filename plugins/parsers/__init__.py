"""Built-in tool-call parsers and reasoning parsers, under SGLang's names."""

from core import hookimpl

CORE_PLUGIN_API = "1"

_T = "core_plugins.parsers.tools:"
_R = "core_plugins.parsers.reasoning:"


@hookimpl
def register_tool_parsers(register):
    register("qwen25", _T + "Qwen25ToolParser")
    register("qwen", _T + "Qwen25ToolParser")
    register("llama3", _T + "Llama3ToolParser")
    register("mistral", _T + "MistralToolParser")
    register("deepseekv3", _T + "DeepSeekV3ToolParser")
    register("pythonic", _T + "PythonicToolParser")
    register("qwen3_coder", _T + "Qwen3CoderToolParser")
    register("kimi_k2", _T + "KimiK2ToolParser")
    register("glm45", _T + "Glm45ToolParser")
    register("gpt-oss", _T + "GptOssToolParser")
    # a bare JSON array of {"name", "parameters"}: what tool_choice "required" is constrained to
    register("json_array", "core_plugins.parsers.json_array:JsonArrayToolParser")


@hookimpl
def register_reasoning_parsers(register):
    register("deepseek-r1", _R + "DeepSeekR1ReasoningParser")
    register("qwen3", _R + "Qwen3ReasoningParser")
    register("qwen3-thinking", _R + "Qwen3ThinkingReasoningParser")
    register("glm45", _R + "Qwen3ReasoningParser")
    register("kimi", _R + "KimiReasoningParser")
    register("gpt-oss", _R + "GptOssReasoningParser")
