"""No field accepted and ignored (issue 41): every field of every request Struct the HTTP server
decodes, of ``SamplingParams`` and of ``EngineArgs``, found by introspection, is classified here
as honoured (naming the test that proves its effect), refused (a 4xx naming it, sent here to a
real app over a tiny model) or ignored by a documented policy (docs/compatibility.md, "Fields
accepted and ignored by design"). A new field without a classification fails the walker, named
with its struct."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any, Iterator

import attrs
import httpx
import msgspec
import pytest

from core.engine.speculative import NGRAM_FLAGS
from tests.conftest import build_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "compatibility.md"
PROMPT = [5 + (i * 7) % 90 for i in range(12)]
MSGS = [{"role": "user", "content": "hi"}]
TEMPLATE = ("{% if greeting is defined %}greeting: {{ greeting }}\n{% endif %}"
            "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
            "{% if documents %}docs: {{ documents | tojson }}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


# ----------------------------------------------------------------------------- classifications
class H:
    """Honoured: ``test`` (``tests.module::function``) proves the effect; its source names the
    field (or one of ``words``, where the test spells it another way)."""

    def __init__(self, test: str, *words: str) -> None:
        self.test, self.words = test, words


class R:
    """Refused: a non-default value (``value``, else one picked from the field's type) is a 4xx naming it."""

    def __init__(self, value: Any = ..., body: dict | None = None) -> None:
        self.value, self.body = value, body


P = "policy"  # ignored by design: the field must be listed in the docs section of that policy

NAT, OAI, VLLM, EMB, NSF = ("tests.test_server_native", "tests.test_openai_api", "tests.test_vllm_compat",
                            "tests.test_models_embedding", "tests.test_no_silent_fields")
SAMPLER, ENGINE, ME = "tests.test_sampler", "tests.test_engine", "tests.test_field_proofs"
DETOK, SCHED, STRUCT = "tests.test_detokenizer", "tests.test_schedule_policy", "tests.test_structured_output"
HUB = "tests.test_hub_ids"
LORA = "tests.test_lora_server"
CLP = "tests.test_custom_logit_processor"

# the fields each chat and completion request shares (_GenerationRequest)
_GENERATION = {
    "model": H(f"{OAI}::test_chat_basic", "whatever-name"),
    "n": H(f"{OAI}::test_chat_n"),
    "stream": H(f"{OAI}::test_chat_stream_matches_non_stream"),
    "stream_options": H(f"{OAI}::test_chat_stream_include_usage"),
    "stop": H(f"{OAI}::test_stop_strings_excluded"),
    "temperature": H(f"{SAMPLER}::test_temperature_sharpens_and_flattens"),
    "top_p": H(f"{SAMPLER}::test_top_p_excludes_the_tail"),
    "frequency_penalty": H(f"{SAMPLER}::test_frequency_and_presence_penalty_exact_values"),
    "presence_penalty": H(f"{SAMPLER}::test_frequency_and_presence_penalty_exact_values"),
    "seed": H(f"{ENGINE}::test_seed_reproduces_and_different_seeds_differ"),
    "user": P,
    "logit_bias": H(f"{OAI}::test_logit_bias_forces_and_bans_tokens"),
    "top_k": H(f"{SAMPLER}::test_top_k_never_samples_outside_the_k_best"),
    "min_p": H(f"{SAMPLER}::test_min_p_drops_tokens_below_fraction_of_max"),
    "min_tokens": H(f"{OAI}::test_chat_message_forms"),
    "repetition_penalty": H(f"{SAMPLER}::test_repetition_penalty_changes_greedy_choice"),
    "stop_token_ids": H(f"{ENGINE}::test_stop_token_ids"),
    "ignore_eos": H(f"{ENGINE}::test_min_new_tokens_and_ignore_eos"),
    "skip_special_tokens": H(f"{DETOK}::test_skip_special_tokens"),
    "spaces_between_special_tokens": H(f"{DETOK}::test_keep_special_tokens_with_spaces"),
    "no_stop_trim": H(f"{DETOK}::test_no_stop_trim_keeps_stop"),
    "rid": H(f"{NAT}::test_request_ids_abort_their_own_group_only"),
    "priority": H(f"{SCHED}::test_priority_field_reaches_the_request"),
    "lora_path": H(f"{LORA}::test_completions_prompts_get_their_adapters"),
    "return_hidden_states": H("tests.test_return_hidden_states::test_openai_endpoints_carry_the_last_tokens_state"),
    "custom_logit_processor": H(f"{CLP}::test_over_http_generate_and_openai"),
    "custom_params": H(f"{CLP}::test_over_http_generate_and_openai"),
    "routed_dp_rank": H("tests.test_dp::test_routed_dp_rank_over_http_body_and_header"),
    "regex": H(f"{VLLM}::test_regex"),
    "json_schema": H(f"{STRUCT}::test_generate_constraints"),
    "ebnf": H(f"{STRUCT}::test_generate_constraints"),
    "response_format": H(f"{STRUCT}::test_openai_response_format"),
    "structured_outputs": H(f"{VLLM}::test_json_schema_and_json_object"),
    "guided_json": H(f"{VLLM}::test_json_schema_and_json_object"),
    "guided_regex": H(f"{VLLM}::test_regex"),
    "guided_choice": H(f"{VLLM}::test_choice_is_exactly_one_of_the_choices"),
    "guided_grammar": H(f"{VLLM}::test_grammar_and_guidance_duplicates"),
    "guided_json_object": H(f"{VLLM}::test_json_schema_and_json_object"),
    "structural_tag": H(f"{VLLM}::test_request_constraint_mapping"),
    "guided_whitespace_pattern": H("tests.test_launch_flags_chat::test_vllms_per_request_json_options_shape_that_requests_output"),
    "include_stop_str_in_output": H(f"{VLLM}::test_vllm_names_of_sglang_options"),
    "request_id": H(f"{VLLM}::test_vllm_names_of_sglang_options"),
}

CLASSIFIED: dict[str, dict[str, Any]] = {
    "GenerateReqInput": {  # the fields of features core lacks (native._UNSUPPORTED_GENERATE_FIELDS) are refused
        "text": H(f"{NAT}::test_generate_text"),
        "input_ids": H(f"{NAT}::test_generate_input_ids_rid_and_batch"),
        "sampling_params": H(f"{NAT}::test_generate_text"),
        "rid": H(f"{NAT}::test_generate_input_ids_rid_and_batch"),
        "return_logprob": H(f"{NAT}::test_generate_logprobs"),
        "logprob_start_len": H("tests.test_model_llama::test_logprob_start_len_offsets_the_prompt_logprobs"),
        "top_logprobs_num": H(f"{NAT}::test_generate_logprobs"),
        "return_text_in_logprobs": H(f"{NAT}::test_generate_logprobs"),
        "stream": H(f"{NAT}::test_generate_stream"),
        "log_metrics": H(f"{ME}::test_log_metrics_false_keeps_a_generate_out_of_the_metrics"),
        "priority": H(f"{SCHED}::test_priority_field_reaches_the_request"),
        "no_logs": H(f"{NAT}::test_no_logs_keeps_a_request_out_of_the_request_log"),
        "lora_path": H(f"{LORA}::test_served_adapter_changes_greedy_tokens_and_repeats"),
        "image_data": H("tests.test_multimodal_inputs::test_generate_image_data_forms"),
        "modalities": H("tests.test_multimodal_inputs::test_generate_image_data_forms"),
        "return_hidden_states": H("tests.test_return_hidden_states::test_generate_endpoint_batch_and_stream"),
        "custom_logit_processor": H(f"{CLP}::test_over_http_generate_and_openai"),
        "token_ids_logprob": H("tests.test_token_ids_logprob::test_generate_returns_them_with_text"),
        "routed_dp_rank": H("tests.test_dp::test_routed_dp_rank_over_http_body_and_header"),
        "data_parallel_rank": H("tests.test_dp::test_routed_dp_rank_over_http_body_and_header"),
        **dict.fromkeys(("routing_key", "conversation_id", "custom_labels", "external_trace_header",
                         "received_time"), P),
    },
    "LoadLoRAAdapterReqInput": {
        "lora_name": H(f"{LORA}::test_served_adapters_load_and_unload_at_run_time"),
        "lora_path": H(f"{LORA}::test_served_adapters_load_and_unload_at_run_time"),
        "pinned": H("tests.test_lora_adapter::test_manager_evicts_least_recently_used_unpinned_unused"),
        "lora_id": R("7"),  # SGLang's internal id
    },
    "UnloadLoRAAdapterReqInput": {
        "lora_name": H(f"{LORA}::test_served_adapters_load_and_unload_at_run_time"),
        "lora_id": R("7"),
    },
    "AbortReq": {
        "rid": H(f"{NAT}::test_abort_request"),
        "abort_all": H(f"{ME}::test_abort_all_gives_its_message_and_update_aborts_running_requests"),
        "abort_message": H(f"{ME}::test_abort_all_gives_its_message_and_update_aborts_running_requests"),
        "finished_reason": R({"type": "stop"}),
    },
    "ProfileReqInput": {
        "output_dir": H(f"{NAT}::test_profile_traces_forward_steps"),
        "num_steps": H(f"{NAT}::test_profile_traces_forward_steps"),
        "profile_prefix": H(f"{NAT}::test_profile_traces_forward_steps"),
        "activities": H(f"{ME}::test_profile_options_reach_the_torch_profiler"),
        "with_stack": H(f"{ME}::test_profile_options_reach_the_torch_profiler"),
        "record_shapes": H(f"{ME}::test_profile_options_reach_the_torch_profiler"),
        "start_step": R(2), "profile_by_stage": R(True), "merge_profiles": R(True),
    },
    "UpdateWeightFromDiskReqInput": {
        "model_path": H(f"{NSF}::test_update_weights_flushes_the_prefix_cache_unless_told_not_to"),
        "flush_cache": H(f"{NSF}::test_update_weights_flushes_the_prefix_cache_unless_told_not_to"),
        "load_format": H(f"{NSF}::test_update_refuses_fields_of_missing_features"),
        "weight_version": H(f"{NAT}::test_update_weights_from_disk"),
        # torch_empty_cache: honoured (AsyncEngine.update_weights_from_disk); recapture_cuda_graph:
        # graphs are always recaptured, so either value is honoured
        "torch_empty_cache": H(f"{NSF}::test_update_is_atomic_with_in_flight_and_new_requests"),
        "recapture_cuda_graph": H(f"{NSF}::test_update_is_atomic_with_in_flight_and_new_requests"),
        "abort_all_requests": H(f"{ME}::test_abort_all_gives_its_message_and_update_aborts_running_requests"),
        "is_async": R(True), "token_step": R(3),
        "keep_pause": H("tests.test_pause_generation::test_the_http_endpoints"),  # (an update never resumes)
    },
    "GetWeightsByNameReqInput": {"name": H("tests.test_weights_by_name::test_the_http_endpoint"),
                                 "truncate_size": H("tests.test_weights_by_name::test_the_http_endpoint")},
    "PauseGenerationReqInput": {"mode": H("tests.test_pause_generation::test_the_http_endpoints")},
    "ContinueGenerationReqInput": {  # (CUDA only: empty_cache in core.engine.pause.resume)
        "torch_empty_cache": H("tests.test_pause_generation::test_the_http_endpoints", "continue_generation")},
    "UpdateWeightVersionReqInput": {
        "new_version": H("tests.test_launch_flags_server::test_update_weight_version_aborts_running_requests_unless_told_not_to"),
        "abort_all_requests": H("tests.test_launch_flags_server::test_update_weight_version_aborts_running_requests_unless_told_not_to"),
    },
    "ScoringRequest": {  # score._UNSUPPORTED are refused
        "model": P,
        **{f: H("tests.test_score::test_scores_are_the_next_token_probabilities_of_the_labels")
           for f in ("query", "items", "label_token_ids", "apply_softmax", "temperature", "return_token_logprobs",
                     "item_first")},
    },
    "ConfigureLoggingReq": {  # request_log._NO_DUMPS are refused
        **{f: H("tests.test_launch_flags_observability::"
                "test_configure_logging_turns_the_request_log_on_and_off_at_run_time")
           for f in ("log_requests", "log_requests_level", "log_requests_format", "log_level")},
        "crash_dump_folder": H("tests.test_robustness_watchdog::test_a_crash_dumps_the_recent_requests"),
    },
    "RerankRequest": {
        **{f: H("tests.test_rerank::test_a_generative_rerankers_scores_are_its_yes_share")
           for f in ("query", "documents", "instruct", "top_n", "return_documents")},
    },
    "TokenizeRequest": {
        "model": P,
        "prompt": H(f"{NAT}::test_tokenize_counts_what_generate_and_chat_send"),
        "messages": H(f"{NAT}::test_tokenize_counts_what_generate_and_chat_send"),
        "add_special_tokens": H(f"{NAT}::test_tokenize_counts_what_generate_and_chat_send"),
        "add_generation_prompt": H(f"{NAT}::test_tokenize_counts_what_generate_and_chat_send"),
        "continue_final_message": H(f"{ME}::test_tokenize_template_options_change_the_count"),
        "tools": H(f"{ME}::test_tokenize_template_options_change_the_count"),
        "chat_template_kwargs": H(f"{ME}::test_tokenize_template_options_change_the_count"),
        "tool_choice": H("tests.test_server_parity::test_tokenize_counts_what_chat_renders"),
        "reasoning_effort": H("tests.test_server_parity::test_tokenize_counts_what_chat_renders"),
        "return_token_strs": H(f"{NAT}::test_tokenize_counts_what_generate_and_chat_send"),
    },
    "DetokenizeRequest": {
        "model": P,
        "tokens": H(f"{ME}::test_tokenize_template_options_change_the_count"),
        "skip_special_tokens": H(f"{ME}::test_tokenize_template_options_change_the_count"),
    },
    "EmbeddingRequest": {  # embeddings._OPENAI_UNSUPPORTED are refused
        "input": H(f"{NSF}::test_embedding_endpoints_honour_refuse_or_log_every_field"),
        "model": P, "user": P,
        "encoding_format": H(f"{ME}::test_embeddings_base64_is_the_float_vector"),
        "dimensions": R(8),
    },
    "EmbeddingReqInput": {  # embeddings._NATIVE_UNSUPPORTED are refused
        "text": H(f"{ME}::test_embeddings_base64_is_the_float_vector"),
        "input_ids": H(f"{NSF}::test_embedding_endpoints_honour_refuse_or_log_every_field"),
        "rid": H(f"{NSF}::test_embedding_endpoints_honour_refuse_or_log_every_field"),
        "log_metrics": P,
    },
    "MessagesRequest": {
        "model": H(f"{OAI}::test_messages_answer_as_chat_does"),
        "messages": H(f"{OAI}::test_messages_answer_as_chat_does"),
        "max_tokens": H(f"{OAI}::test_messages_answer_as_chat_does"),
        "system": H(f"{OAI}::test_messages_answer_as_chat_does"),
        "stop_sequences": H(f"{OAI}::test_messages_answer_as_chat_does"),
        "stream": H(f"{OAI}::test_messages_stream_events"),
        "temperature": H(f"{ME}::test_messages_sampling_fields_reach_the_chat_request"),
        "top_p": H(f"{ME}::test_messages_sampling_fields_reach_the_chat_request"),
        "top_k": H(f"{ME}::test_messages_sampling_fields_reach_the_chat_request"),
        "tools": H(f"{OAI}::test_messages_tool_use_round_trip"),
        "tool_choice": H(f"{OAI}::test_messages_tool_use_round_trip"),
        "thinking": H(f"{ME}::test_messages_sampling_fields_reach_the_chat_request"),
        "output_config": H(f"{OAI}::test_messages_json_output_format"),
        "metadata": P,
        "container": R({"id": "c"}), "mcp_servers": R([{"type": "url", "url": "http://x", "name": "x"}]),
    },
    "CountTokensRequest": {
        **dict.fromkeys(("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"),
                        H(f"{OAI}::test_messages_count_tokens_checks_what_messages_checks", "count_tokens")),
        "mcp_servers": R([{"type": "url", "url": "http://x", "name": "x"}]),
    },
    "ChatCompletionRequest": {
        **_GENERATION,
        "messages": H(f"{OAI}::test_chat_message_forms"),
        "max_tokens": H(f"{OAI}::test_chat_length_and_max_completion_tokens"),
        "max_completion_tokens": H(f"{OAI}::test_chat_length_and_max_completion_tokens"),
        "logprobs": H(f"{OAI}::test_chat_logprobs"),
        "top_logprobs": H(f"{OAI}::test_chat_logprobs"),
        "tools": H(f"{OAI}::test_chat_template_override_and_tools"),
        "tool_choice": H(f"{STRUCT}::test_tool_choice_required_and_named"),
        "parallel_tool_calls": H(f"{STRUCT}::test_tool_choice_required_and_named"),
        "chat_template_kwargs": H(f"{OAI}::test_chat_template_override_and_tools"),
        "documents": H(f"{ME}::test_tokenize_template_options_change_the_count"),
        "continue_final_message": H(f"{OAI}::test_messages_continue_an_assistant_prefill"),
        "separate_reasoning": H("tests.test_parsers::test_tool_plan_decides_mode_constraint_and_parsers_once"),
        "thinking_token_budget": H("tests.test_openai_tool_fields::test_a_thinking_budget_closes_the_reasoning"),
        "reasoning_effort": H(f"{VLLM}::test_check_fields_on_batch_bodies_and_reasoning_effort"),
    },
    "CompletionRequest": {
        **_GENERATION,
        "prompt": H(f"{OAI}::test_completion_prompt_forms"),
        "max_tokens": H(f"{OAI}::test_completion_basic_and_default_max_tokens"),
        "echo": H(f"{OAI}::test_completion_echo_and_logprobs"),
        "logprobs": H(f"{OAI}::test_completion_echo_and_logprobs"),
        "suffix": H("tests.test_completion_template::test_suffix_completions_read_the_fim_prompt"), "best_of": R(3),
    },
    "StructuredOutputs": {
        "json": H(f"{VLLM}::test_json_schema_and_json_object"),
        "regex": H(f"{VLLM}::test_regex"),
        "choice": H(f"{VLLM}::test_choice_is_exactly_one_of_the_choices"),
        "grammar": H(f"{VLLM}::test_grammar_and_guidance_duplicates"),
        "json_object": H(f"{VLLM}::test_json_schema_and_json_object"),
        "structural_tag": H(f"{VLLM}::test_request_constraint_mapping"),
        "disable_fallback": H(f"{VLLM}::test_request_constraint_mapping"),  # honoured: no other backend to fall back to
        "backend": P,
        "disable_any_whitespace": H("tests.test_launch_flags_chat::test_vllms_per_request_json_options_shape_that_requests_output"),
        "whitespace_pattern": H("tests.test_launch_flags_chat::test_vllms_per_request_json_options_shape_that_requests_output"),
        "disable_additional_properties": H(
            "tests.test_launch_flags_chat::test_disable_additional_properties_closes_every_object_of_the_schema"),
    },
    "StreamOptions": {
        "include_usage": H(f"{OAI}::test_chat_stream_include_usage"),
        "continuous_usage_stats": H(f"{ME}::test_continuous_usage_stats_puts_the_usage_in_every_chunk"),
    },
    "BatchRequest": dict.fromkeys(("input_file_id", "endpoint", "completion_window", "metadata"),
                                  H(f"{OAI}::test_files_and_batches_round_trip")),
    "ResponsesRequest": {
        "background": H(f"{OAI}::test_responses_in_the_background"),
        "model": H(f"{OAI}::test_responses_answer_as_chat_does_and_continue_a_conversation"),
        "input": H(f"{OAI}::test_responses_answer_as_chat_does_and_continue_a_conversation"),
        "instructions": H(f"{OAI}::test_responses_answer_as_chat_does_and_continue_a_conversation"),
        "previous_response_id": H(f"{OAI}::test_responses_answer_as_chat_does_and_continue_a_conversation"),
        "max_output_tokens": H(f"{OAI}::test_responses_answer_as_chat_does_and_continue_a_conversation"),
        "store": H(f"{OAI}::test_responses_answer_as_chat_does_and_continue_a_conversation"),
        "tools": H(f"{OAI}::test_responses_function_call_round_trip"),
        "tool_choice": H(f"{OAI}::test_responses_function_call_round_trip"),
        "parallel_tool_calls": H(f"{OAI}::test_responses_function_call_round_trip"),
        "stream": H(f"{OAI}::test_responses_stream_events"),
        "reasoning": H(f"{OAI}::test_responses_stream_items_open_and_close_in_order"),
        "include": H(f"{ME}::test_responses_fields_reach_the_chat_request"),
        "top_logprobs": H(f"{ME}::test_responses_fields_reach_the_chat_request"),
        **dict.fromkeys(("text", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "ignore_eos",
                         "chat_template_kwargs", "request_id", "priority", "metadata", "user", "frequency_penalty",
                         "presence_penalty", "stop"),
                        H(f"{ME}::test_responses_fields_reach_the_chat_request")),
        "truncation": R("auto"), "conversation": R("conv_1"), "prompt": R({"id": "p"}),
    },
    "SamplingParams": {
        "max_new_tokens": H(f"{ENGINE}::test_max_new_tokens_zero_returns_only_prompt_logprobs"),
        "min_new_tokens": H(f"{ENGINE}::test_min_new_tokens_and_ignore_eos"),
        "temperature": H(f"{SAMPLER}::test_temperature_sharpens_and_flattens"),
        "top_p": H(f"{SAMPLER}::test_top_p_excludes_the_tail"),
        "top_k": H(f"{SAMPLER}::test_top_k_never_samples_outside_the_k_best"),
        "min_p": H(f"{SAMPLER}::test_min_p_drops_tokens_below_fraction_of_max"),
        "frequency_penalty": H(f"{SAMPLER}::test_frequency_and_presence_penalty_exact_values"),
        "presence_penalty": H(f"{SAMPLER}::test_frequency_and_presence_penalty_exact_values"),
        "repetition_penalty": H(f"{SAMPLER}::test_repetition_penalty_exact_values"),
        "stop": H(f"{DETOK}::test_stop_strings_and_regex_together"),
        "stop_token_ids": H(f"{ENGINE}::test_stop_token_ids"),
        "stop_regex": H(f"{NAT}::test_generate_stop_regex"),
        "ignore_eos": H(f"{ENGINE}::test_min_new_tokens_and_ignore_eos"),
        "skip_special_tokens": H(f"{DETOK}::test_skip_special_tokens"),
        "spaces_between_special_tokens": H(f"{DETOK}::test_keep_special_tokens_with_spaces"),
        "no_stop_trim": H(f"{DETOK}::test_no_stop_trim_keeps_stop"),
        "n": H(f"{ENGINE}::test_n_returns_n_outputs"),
        "seed": H(f"{ENGINE}::test_seed_reproduces_and_different_seeds_differ"),
        "logit_bias": H(f"{SAMPLER}::test_logit_bias_moves_greedy_and_sampled_choices_per_row"),
        "custom_params": H(f"{CLP}::test_processors_drive_their_own_rows_with_live_outputs"),
        "custom_logit_processor": H(f"{CLP}::test_processors_drive_their_own_rows_with_live_outputs"),
        "json_schema": H(f"{STRUCT}::test_generate_constraints"),
        "regex": H(f"{VLLM}::test_regex"),
        "ebnf": H(f"{STRUCT}::test_generate_constraints"),
        "structural_tag": H(f"{VLLM}::test_request_constraint_mapping"),
        "thinking": H("tests.test_openai_tool_fields::test_a_thinking_budget_leaves_an_answer_without_reasoning_alone"),
        "json_options": H("tests.test_launch_flags_chat::test_disable_additional_properties_closes_every_object_of_the_schema"),
        "reasoning_gate": H("tests.test_openai_tool_fields::test_a_hybrid_models_first_token_decides_whether_it_reasons",
                            "enable_thinking"),
    },
    "EngineArgs": {
        "model_path": H(f"{NSF}::test_update_flushes_every_data_parallel_replica"),
        "tokenizer_path": H(f"{HUB}::test_tokenizer_path_and_served_name_resolve_through_the_same_resolver"),
        "revision": H(f"{HUB}::test_revision_picks_the_snapshot_of_a_branch_or_commit"),
        "served_model_name": H(f"{HUB}::test_tokenizer_path_and_served_name_resolve_through_the_same_resolver"),
        "download_dir": H(f"{HUB}::test_download_dir_is_the_cache_hub_ids_resolve_in"),
        "decode_log_interval": H("tests.test_launch_flags::test_prefill_and_decode_batches_are_logged_as_sglang_does"),
        "sleep_on_idle": H("tests.test_launch_flags::test_flags_sglang_launch_commands_carry_are_accepted"),
        "disable_custom_all_reduce": P, "enable_p2p_check": P,
        **{f: H("tests.test_launch_flags::test_gpu_placement_follows_sglangs_base_gpu_id_and_gpu_id_step")
           for f in ("base_gpu_id", "gpu_id_step")},
        "dtype": H("tests.test_cpu_attention::test_bfloat16_engine_is_as_close_to_float32_as_torch_native"),
        "context_length": H("tests.test_loader::test_context_length_cannot_exceed_the_model"),
        "skip_tokenizer_init": H(f"{ENGINE}::test_text_prompt_without_tokenizer"),
        "json_model_override_args": H(f"{EMB}::test_dummy_weights_and_model_override_args"),
        "load_format": H("tests.test_loader::test_load_format_reads_only_the_named_format"),
        "is_embedding": H(f"{EMB}::test_http_endpoints"),
        "device": H("tests.test_conformance_quant::test_device_support_declaration_is_honoured_on_cpu"),
        "mem_fraction_static": H("tests.test_startup_budget::test_a_tiny_fraction_names_mem_fraction_static",
                                 "mem-fraction-static"),
        "max_total_tokens": H(f"{ENGINE}::test_request_larger_than_the_pool_is_rejected"),
        "max_running_requests": H("tests.test_retraction::test_max_running_requests_caps_the_batch"),
        "max_prefill_tokens": H(f"{ME}::test_engine_args_reach_the_engine"),
        "chunked_prefill_size": H("tests.test_chunked_prefill::test_chunked_outputs_equal_unchunked"),
        "enable_mixed_chunk": H("tests.test_cpu_attention::test_engine_greedy_tokens_equal_torch_native"),
        "num_continuous_decode_steps": H(
            "tests.test_continuous_decode::test_the_first_token_streams_before_the_first_burst"),
        "speculative_algorithm": H("tests.test_speculative::test_greedy_tokens_are_plain_decodings_and_drafts_are_partly_kept"),
        "speculative_num_draft_tokens": H("tests.test_speculative::test_bad_speculative_flags_are_clear_errors"),
        "speculative_num_steps": H("tests.test_speculative_draft_model::test_the_target_as_its_own_draft_has_its_chains_accepted"),
        "speculative_eagle_topk": H("tests.test_speculative_draft_model::test_bad_draft_set_ups_are_clear_errors"),
        "speculative_draft_model_path": H("tests.test_speculative_draft_model::test_another_draft_gives_plain_greedy_tokens"),
        **{f"speculative_ngram_{f}": H("tests.test_speculative::test_sglangs_ngram_flags_shape_the_drafts", f)
           for f in NGRAM_FLAGS},
        **{f"speculative_accept_threshold_{f}": H("tests.test_speculative_accept::test_below_one_drafts_are_kept_as_the_rule_says")
           for f in ("single", "acc")},
        "disable_overlap_schedule": H("tests.test_overlap_schedule::test_overlap_flags"),
        "enable_overlap_schedule": H("tests.test_overlap_schedule::test_overlap_flags"),
        "schedule_policy": H(f"{SCHED}::test_engine_policies_give_the_same_outputs"),
        "schedule_conservativeness": H(f"{ME}::test_engine_args_reach_the_engine"),
        "enable_priority_scheduling": H(f"{SCHED}::test_priority_field_reaches_the_request"),
        "schedule_low_priority_values_first": H(f"{SCHED}::test_priority_scheduling", "low_first"),
        "disable_radix_cache": H("tests.test_chunked_prefill::test_chunked_outputs_equal_unchunked"),
        "radix_eviction_policy": H(f"{ME}::test_engine_args_reach_the_engine"),
        "page_size": H("tests.test_radix_cache::test_page_size_matches_whole_pages_only"),
        "enable_hierarchical_cache": H("tests.test_hicache::test_prefix_evicted_by_other_prompts_is_served_from_the_host"),
        "hicache_ratio": H("tests.test_hicache::test_full_host_pool_drops_its_lru_prefixes_and_stays_consistent"),
        "hicache_size": H("tests.test_hicache::test_flags_parse_and_bad_values_are_clear_errors"),
        "enable_multimodal": H("tests.test_vlm_engine::test_enable_multimodal_false_refuses_images_and_a_text_only_model_ignores_the_flag"),
        "limit_mm_data_per_request": H("tests.test_multimodal_inputs::test_offline_refuses_urls_and_the_policy_follows_sglang_flags"),
        "allowed_media_domains": H("tests.test_multimodal_inputs::test_offline_refuses_urls_and_the_policy_follows_sglang_flags"),
        "media_url_max_file_size_mb": H("tests.test_multimodal_inputs::test_offline_refuses_urls_and_the_policy_follows_sglang_flags"),
        "allowed_local_media_path": H("tests.test_multimodal_inputs::test_offline_refuses_urls_and_the_policy_follows_sglang_flags"),
        "enable_lora": H("tests.test_lora_engine::test_load_and_unload_at_run_time"),
        "lora_paths": H("tests.test_lora_engine::test_max_loaded_loras_and_the_slot_eviction_policy"),
        "max_loras_per_batch": H("tests.test_lora_engine::test_max_loaded_loras_and_the_slot_eviction_policy"),
        "max_lora_rank": H("tests.test_lora_engine::test_load_and_unload_at_run_time"),
        "lora_target_modules": H("tests.test_lora_engine::test_load_and_unload_at_run_time"),
        "max_loaded_loras": H("tests.test_lora_engine::test_max_loaded_loras_and_the_slot_eviction_policy"),
        "lora_backend": H("tests.test_lora_engine::test_sglang_lora_flags_parse_into_engine_args"),
        "lora_eviction_policy": H("tests.test_lora_engine::test_max_loaded_loras_and_the_slot_eviction_policy"),
        "hicache_write_policy": H("tests.test_hicache::test_prefix_evicted_by_other_prompts_is_served_from_the_host"),
        "hicache_io_backend": H("tests.test_hicache::test_flags_parse_and_bad_values_are_clear_errors"),
        "hicache_mem_layout": H("tests.test_hicache::test_flags_parse_and_bad_values_are_clear_errors"),
        "hicache_storage_backend": H("tests.test_hicache_storage::test_prefix_survives_a_restart_in_the_file_tier",
                                    "storage-backend"),
        "hicache_storage_prefetch_policy": H("tests.test_hicache_storage::test_prefix_survives_a_restart_in_the_file_tier",
                                             "storage-prefetch-policy"),
        "kv_cache_dtype": H("tests.test_quant_models::test_fp8_kv_cache_tracks_the_bf16_pool"),
        "random_seed": H(f"{ME}::test_engine_args_reach_the_engine"),
        "cpu_threads": H(f"{ME}::test_engine_args_reach_the_engine"),
        "watchdog_timeout": H("tests.test_robustness_watchdog::test_watchdog_fails_in_flight_requests_and_health",
                              "--watchdog-timeout"),
        "soft_watchdog_timeout": H("tests.test_robustness_watchdog::test_soft_watchdog_logs_a_slow_step_once_and_lets_it_finish",
                                   "--soft-watchdog-timeout"),
        "retraction_policy": H("tests.test_retraction::test_retraction_policy_picks_the_victim"),
        "prefill_max_requests": H("tests.test_scheduler::test_prefill_max_requests_reaches_the_scheduler"),
        "default_priority_value": H("tests.test_schedule_policy::test_default_priority_value_and_abort_on_priority_when_disabled"),
        "abort_on_priority_when_disabled": H(
            "tests.test_schedule_policy::test_default_priority_value_and_abort_on_priority_when_disabled"),
        "enable_custom_logit_processor": H(f"{CLP}::test_refused_without_the_flag_and_with_bad_values"),
        "enable_return_hidden_states": H("tests.test_return_hidden_states::test_offline_engine_returns_transformers_hidden_states"),
        "return_hidden_states_mode": H("tests.test_return_hidden_states::test_without_the_flag_requests_are_refused_as_sglang_does"),
        "attention_backend": H("tests.test_attention_choice::test_explicit_flag_wins_over_the_choice"),
        "prefill_attention_backend": H("tests.test_attention_phases::test_each_phase_runs_on_the_backend_named"),
        "decode_attention_backend": H("tests.test_attention_phases::test_each_phase_runs_on_the_backend_named"),
        "quantization": H("tests.test_quant_models::test_weight_only_methods_track_the_dense_model"),
        "torchao_config": H("tests.test_quant_models::test_torchao_config_selects_the_method"),
        "cuda_graph_max_bs": H("tests.test_cuda_graph::test_greedy_tokens_equal_with_graphs_on_and_off"),
        "disable_cuda_graph": H("tests.test_cuda_graph::test_greedy_tokens_equal_with_graphs_on_and_off"),
        "grammar_backend": H(f"{VLLM}::test_choice_regex_reads_as_literals_in_the_grammar_backends"),
        "constrained_json_whitespace_pattern": H("tests.test_launch_flags_chat::test_json_whitespace_flags_give_compact_constrained_output"),
        "constrained_json_disable_any_whitespace": H("tests.test_launch_flags_chat::test_json_whitespace_flags_give_compact_constrained_output"),
        "constrained_json_max_whitespace_cnt": H("tests.test_launch_flags_chat::test_json_whitespace_flags_give_compact_constrained_output"),
        "weight_loader_disable_mmap": H("tests.test_loader::test_weight_loader_disable_mmap_reads_files_whole"),
        "enable_memory_saver": H("tests.test_memory_saver::test_release_and_resume_with_a_cpu_backup"),
        "enable_weights_cpu_backup": H("tests.test_memory_saver::test_release_and_resume_with_a_cpu_backup"),
        "enable_tf32_matmul": H("tests.test_launch_flags::test_enable_tf32_matmul_sets_cudas_float32_precision"),
        "enable_deterministic_inference": H("tests.test_deterministic::test_a_request_is_the_same_in_any_batch"),
        "enable_fp32_lm_head": H("tests.test_lm_head_fp32::test_served_logprobs_come_from_the_float32_logits"),
        "plugins": H(f"{ME}::test_engine_plugins_and_strict_plugins_reach_load_plugins"),
        "strict_plugins": H(f"{ME}::test_engine_plugins_and_strict_plugins_reach_load_plugins"),
        "tp_size": H("tests.test_tp::test_tp2_matches_one_rank"),
        "dp_size": H("tests.test_dp::test_round_robin_spreads_and_matches_one_engine"),
        "load_balance_method": H("tests.test_dp::test_prefix_aware_routing_reuses_one_replicas_cache"),
        "dist_init_addr": H("tests.test_tp::test_ranks_on_two_nodes"),
        "nnodes": H("tests.test_tp::test_ranks_on_two_nodes"),
        "node_rank": H("tests.test_tp::test_ranks_on_two_nodes"),
        "dist_timeout": H("tests.test_tp::test_killed_rank_fails_in_flight_requests_within_the_timeout"),
        "log_level": H("tests.test_cli_first_hour::test_a_slow_cpu_dtype_is_warned_about"),
        "gc_warning_threshold_secs": H("tests.test_gc_watch::test_the_flags_parse_with_sglangs_defaults_and_bad_values_are_refused",
                                       "--gc-warning-threshold-secs"),
        "gc_threshold": H("tests.test_gc_watch::test_the_flag_reaches_the_engine_and_engine_freeze_gc_freezes",
                          "--gc-threshold"),
        "extra": H(f"{NAT}::test_plugin_cli_options_reach_engine_args_extra"),
    },
}


# ----------------------------------------------------------------------------- the structs
def _structs() -> dict[str, Any]:
    from core.engine.config import EngineArgs
    from core.engine.sampling_params import SamplingParams
    from core.server import anthropic, embeddings, lora, native, profile, request_log, tokenize
    from core.server.openai import protocol, rerank, responses, score

    out: dict[str, Any] = {}
    for module in (native, lora, profile, tokenize, embeddings, anthropic, protocol, responses, score, rerank,
                   request_log):
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__
                    and not name.startswith("_")
                    and re.search(r"Req(uest|Input)?$|^StructuredOutputs$|^StreamOptions$", name)):
                out[name] = obj
    out["SamplingParams"], out["EngineArgs"] = SamplingParams, EngineArgs
    return out


def _fields(typ: Any) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(typ)) if attrs.has(typ) else typ.__struct_fields__


def _server_refused() -> dict[str, tuple[str, ...]]:
    """The fields each struct's server code refuses by its own list (the walker probes each)."""
    from core.server import embeddings, native
    from core.server.openai import score

    from core.server import request_log

    return {"GenerateReqInput": native._UNSUPPORTED_GENERATE_FIELDS, "ScoringRequest": score._UNSUPPORTED,
            "ConfigureLoggingReq": request_log._NO_DUMPS,
            "EmbeddingRequest": embeddings._OPENAI_UNSUPPORTED, "EmbeddingReqInput": embeddings._NATIVE_UNSUPPORTED}


def _classification() -> dict[str, dict[str, Any]]:
    table = {k: dict(v) for k, v in CLASSIFIED.items()}
    for name, fields in _server_refused().items():
        for f in fields:
            table[name].setdefault(f, R())
    return table


def _policy_section() -> str:
    text = DOCS.read_text()
    start = text.index("## Fields accepted and ignored by design")
    end = text.find("\n## ", start + 3)
    return text[start:end if end >= 0 else None]


def test_every_field_of_every_struct_is_classified() -> None:
    structs, table = _structs(), _classification()
    wanted = {"GenerateReqInput", "AbortReq", "ProfileReqInput", "UpdateWeightFromDiskReqInput", "TokenizeRequest",
              "DetokenizeRequest", "EmbeddingRequest", "EmbeddingReqInput", "MessagesRequest", "CountTokensRequest",
              "ChatCompletionRequest", "CompletionRequest", "StructuredOutputs", "StreamOptions", "BatchRequest",
              "ResponsesRequest", "SamplingParams", "EngineArgs"}
    assert wanted <= set(structs), f"the walker lost structs: {sorted(wanted - set(structs))}"
    problems = []
    for name, typ in structs.items():
        fields, classes = set(_fields(typ)), table.get(name, {})
        problems += [f"{name}.{f}: not classified (honoured, refused or ignored by policy)"
                     for f in sorted(fields - set(classes))]
        problems += [f"{name}.{f}: classified but not a field" for f in sorted(set(classes) - fields)]
    assert set(table) <= set(structs), sorted(set(table) - set(structs))
    assert not problems, "\n".join(problems)


def test_every_honoured_field_names_a_test_that_exists_and_names_it() -> None:
    sources: dict[str, str] = {}
    problems = []
    for name, classes in _classification().items():
        for field, c in classes.items():
            if not isinstance(c, H):
                continue
            module, _, func = c.test.partition("::")
            fn = getattr(importlib.import_module(module), func, None)
            if fn is None or not callable(fn):
                problems.append(f"{name}.{field}: {c.test} does not exist")
                continue
            src = sources.setdefault(c.test, inspect.getsource(fn))
            words = c.words or (field,)
            if not any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", src) for w in words):
                problems.append(f"{name}.{field}: {c.test} never mentions {' / '.join(words)}")
    assert not problems, "\n".join(problems)


def test_every_field_ignored_by_policy_is_declared_and_documented() -> None:
    from core.server.openai.protocol import IGNORED_FIELDS

    section = _policy_section()
    documented = set(re.findall(r"[`.]([a-z0-9_]+)`", section))
    policy = {f for classes in _classification().values() for f, c in classes.items() if c == P}
    missing = sorted((policy | IGNORED_FIELDS) - documented)
    assert not missing, f"docs/compatibility.md's policy section does not list: {missing}"


# ----------------------------------------------------------------------------- EngineArgs refusals
def test_unsupported_engine_args_are_refused_naming_them() -> None:
    from core.engine.config import UNSUPPORTED_SGLANG_ARGS, EngineArgs, engine_args_from_kwargs
    from core.errors import CoreError

    assert not set(UNSUPPORTED_SGLANG_ARGS) & set(_fields(EngineArgs))
    for name, off in UNSUPPORTED_SGLANG_ARGS.items():
        for value in (True, 2, "on", ["x"]):
            if any(type(value) is type(d) and value == d for d in off):
                continue
            with pytest.raises(CoreError, match=rf"not supported.*\b{name}\b"):
                engine_args_from_kwargs({"model_path": "/m", name: value})
        for value in off:  # the "off" value is accepted
            engine_args_from_kwargs({"model_path": "/m", name: value})


# ----------------------------------------------------------------------------- the apps
@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("walker-model")
    build_tiny_llama(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


class App:
    """One engine and its ASGI app, driven from a private event loop (module-scoped)."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        from core.engine import AsyncEngine
        from core.engine.config import engine_args_from_kwargs
        from core.server.app import create_app
        from core.server.args import ServerArgs
        from core.server.state import build_state

        self.loop = asyncio.new_event_loop()
        opts = dict(model_path=str(path), dtype="float32", max_total_tokens=1024, cpu_threads=1, device="cpu",
                    grammar_backend="none")
        self.engine = self.run_async(self._make(AsyncEngine, engine_args_from_kwargs({**opts, **kwargs})))
        self.state = build_state(self.engine, ServerArgs(enable_metrics=True))
        self.state.ready = True
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(self.state)), base_url="http://t",
                                        timeout=60)

    @staticmethod
    async def _make(cls: Any, args: Any) -> Any:
        return cls(args)

    def run_async(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def post(self, path: str, body: Any) -> httpx.Response:
        return self.run_async(self.client.post(path, json=body))

    def close(self) -> None:
        self.run_async(self.client.aclose())
        self.run_async(self.engine.shutdown())
        self.loop.close()


@pytest.fixture(scope="module")
def app(model_path: Path) -> Iterator[App]:
    a = App(model_path, max_prefill_tokens=4000, schedule_conservativeness=2.0, radix_eviction_policy="lfu",
            random_seed=5, strict_plugins=True)
    yield a
    a.close()


@pytest.fixture(scope="module")
def embed_app(model_path: Path) -> Iterator[App]:
    a = App(model_path, is_embedding=True)
    yield a
    a.close()


def _sample_value(hint: Any) -> Any:
    """A value of type ``hint`` that is no field's default (nor an "off" value)."""
    kinds = set(typing.get_args(hint)) or {hint}
    for kind, value in ((bool, True), (int, 7), (float, 0.5), (str, "x")):
        if kind in kinds:
            return value
    if any(typing.get_origin(k) is list or k is list for k in kinds):
        return ["x"]
    if any(typing.get_origin(k) is dict or k is dict for k in kinds):
        return {"x": 1}
    return "x"  # Any


# struct -> (endpoint, minimal valid body, app fixture name)
ENDPOINTS = {
    "GenerateReqInput": ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}, "app"),
    "AbortReq": ("/abort_request", {"rid": "none-such"}, "app"),
    "LoadLoRAAdapterReqInput": ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/none"}, "app"),
    "UnloadLoRAAdapterReqInput": ("/unload_lora_adapter", {"lora_name": "a"}, "app"),
    "ProfileReqInput": ("/start_profile", {}, "app"),
    "UpdateWeightFromDiskReqInput": ("/update_weights_from_disk", {"model_path": "<model>"}, "app"),
    "EmbeddingRequest": ("/v1/embeddings", {"input": PROMPT}, "embed_app"),
    "EmbeddingReqInput": ("/encode", {"input_ids": PROMPT}, "embed_app"),
    "MessagesRequest": ("/v1/messages", {"messages": MSGS, "max_tokens": 1}, "app"),
    "CountTokensRequest": ("/v1/messages/count_tokens", {"messages": MSGS}, "app"),
    "ChatCompletionRequest": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}, "app"),
    "CompletionRequest": ("/v1/completions", {"prompt": "hi", "max_tokens": 1}, "app"),
    "StructuredOutputs": ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}, "app"),
    "ResponsesRequest": ("/v1/responses", {"input": "hi", "max_output_tokens": 1}, "app"),
    "ScoringRequest": ("/v1/score", {"query": PROMPT[:3], "items": [[5]], "label_token_ids": [5]}, "app"),
    "ConfigureLoggingReq": ("/configure_logging", {}, "app"),
}


def _refusals() -> list[tuple[str, str, Any]]:
    structs, out = _structs(), []
    for name, classes in _classification().items():
        for field, c in classes.items():
            if isinstance(c, R):
                hint = typing.get_type_hints(structs[name]).get(field, Any)
                out.append((name, field, _sample_value(hint) if c.value is ... else c.value))
    return out


def _assert_refused(r: httpx.Response, field: str, where: str) -> None:
    assert 400 <= r.status_code < 500, (where, r.status_code, r.text)
    body = r.json()
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict), (where, body)
    if "param" in err or body.get("type") != "error":  # OpenAI's shape names the field in param
        assert field in (err.get("param") or ""), (where, body)
    else:  # Anthropic's shape has no param: the message names it
        assert field in err["message"], (where, body)


def test_every_refused_field_is_a_4xx_naming_it(request: pytest.FixtureRequest, model_path: Path) -> None:
    apps = {"app": request.getfixturevalue("app"), "embed_app": request.getfixturevalue("embed_app")}
    probes = _refusals()
    assert len(probes) >= 60
    for name, field, value in probes:
        path, base, which = ENDPOINTS[name]
        body = json.loads(json.dumps(base).replace("<model>", str(model_path)))
        extra = CLASSIFIED.get(name, {}).get(field)
        if name == "StructuredOutputs":
            body["structured_outputs"] = {**(extra.body or {}), field: value}
        else:
            body[field] = value
        _assert_refused(apps[which].post(path, body), field, f"{name}.{field}={value!r} on {path}")


def test_sampling_keys_and_noop_fields_of_missing_features_are_refused(app: App) -> None:
    """The sampling keys /generate refuses and the chat / completions no-op fields (accepted only
    "off") are a 400 naming them at any other value."""
    from core.server.native import _UNSUPPORTED_SAMPLING_KEYS
    from core.server.openai.protocol import NOOP_FIELDS, ChatCompletionRequest

    for key in _UNSUPPORTED_SAMPLING_KEYS:
        r = app.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, key: 7}})
        _assert_refused(r, key, f"sampling_params.{key}")
    for typ, fields in NOOP_FIELDS.items():
        path, base, _ = ENDPOINTS[typ.__name__]
        for field, off in fields.items():
            value = 7 if 7 not in off else "on"
            _assert_refused(app.post(path, {**base, field: value}), field, f"{typ.__name__} {field}")
            r = app.post(path, {**base, field: off[0]})
            assert r.status_code == 200, (field, off[0], r.text)
    assert ChatCompletionRequest in NOOP_FIELDS
