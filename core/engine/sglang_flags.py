"""SGLang's server flags that core does not have: data, so that a user's SGLang launch command (or
``Engine(**kwargs)``) names what this server lacks instead of "unrecognized arguments"."""

from __future__ import annotations

# SGLang 0.5.23's server flags that `core serve` lacks (its ServerArgs: the `A[...]` fields of
# sglang/srt/arg_groups/fields/*.py, their cli_name/aliases, less `no_cli`, plus server_args.py's explicit
# add_argument calls; extracted from the source text, minus the flags core's serve parser knows). A flag core
# adds later is parsed before this list is consulted, so the list only has to be complete, not minimal.
SGLANG_FLAGS_LACKING: frozenset[str] = frozenset("--" + name for name in """
asr-max-buffer-seconds
asr-max-concurrent-sessions attention-context-parallel-size attention-data-parallel-size attn-cp-size attn-dp-size
batch-notify-size bf16-gemm-backend boundary-reduction 
c128-page-size checkpoint-engine-wait-weights-before-ready

context-bucket cp-strategy cpu-offload-gb 
cuda-graph-backend-decode cuda-graph-backend-prefill cuda-graph-bs-decode cuda-graph-bs-prefill cuda-graph-config
cuda-graph-max-bs-decode cuda-graph-max-bs-prefill cuda-graph-max-seq-len-prefill cuda-graph-prefill-max-context
custom-weight-loader dcp-comm-backend dcp-replicate-q-proj dcp-size debug-cuda-graph debug-tensor-dump-input-file
debug-tensor-dump-layers debug-tensor-dump-output-folder decode-context-parallel-size
decoupled-spec-bind-endpoint decoupled-spec-connect-endpoints decoupled-spec-rank
decoupled-spec-role decrypted-config-file decrypted-draft-config-file deepep-config deepep-dispatcher-output-dtype
deepep-mode deepep-v2-mode delete-ckpt-after-loading
detokenizer-worker-num disable-aiter-allreduce-fusion-in-decode disable-aiter-allreduce-fusion-in-prefill
disable-attn-tp-gather disable-chunked-prefix-cache disable-cuda-graph-padding 
disable-decode-cuda-graph disable-fast-image-processor disable-flashinfer-autotune
disable-flashinfer-cutlass-moe-fp4-allgather disable-hybrid-swa-memory disable-outlines-disk-cache
 disable-prefill-cuda-graph disable-priority-preemption disable-shared-experts-fusion
disable-tokenizer-batch-decode disaggregation-bootstrap-port disaggregation-decode-allocation-policy
disaggregation-decode-enable-offload-kvcache disaggregation-decode-enable-radix-cache
disaggregation-decode-extra-slots disaggregation-decode-host-receive-threshold
disaggregation-decode-polling-interval disaggregation-decode-retraction-backup disaggregation-enable-kv-checksum
disaggregation-ib-device disaggregation-transfer-backend dllm-algorithm dllm-algorithm-config dllm-fdfo 
dsa-decode-backend dsa-paged-mqa-logits-backend dsa-prefill-backend dsa-topk-backend dsa-triton-union
dsv4-attn-backend dsv4-prefill-backend dwdp-size dynamic-batch-tokenizer-batch-size
dynamic-batch-tokenizer-batch-timeout elastic-ep-backend elastic-ep-initial-size elastic-ep-join-mode
elastic-ep-join-rank-offset elastic-ep-scale-timeout enable-adaptive-dispatch-to-encoder
enable-aiter-allreduce-fusion enable-amd-monokernel enable-attn-tp-input-scattered
enable-broadcast-mm-inputs-process enable-cp-decode-attn-tp enable-cudagraph-gc
enable-decoder-swa-bounded-replay enable-deepseek-v4-fp4-indexer enable-dense-mlp-attn-tp
enable-dp-attention-local-control-broadcast enable-dp-lm-head
enable-draft-weights-cpu-backup enable-dsa-cache-layer-split enable-dsa-fused-indexer enable-dynamic-batch-tokenizer
enable-dynamic-chunking enable-elastic-expert-backup enable-encoder-swa-bounded-replay enable-eplb
enable-flashinfer-allreduce-fusion enable-flexkv enable-forward-pass-metrics 
enable-fused-moe-sum-all-reduce enable-fused-qk-norm-rope enable-hisparse
enable-http-worker-reuseport enable-int8-mamba-checkpoint enable-kv-cache-sharding enable-layernorm-sp
enable-layerwise-nvtx-marker enable-lean-attention enable-linear-replayssm enable-linear-replayssm-spec
enable-linker-mla-dedup enable-lmcache enable-lora-overlap-loading enable-mamba-cache-stochastic-rounding
enable-megamoe-for-layernorm-sp enable-metrics-for-all-schedulers enable-mfu-metrics enable-mis
enable-mm-global-cache enable-mscclpp enable-multi-layer-eagle enable-nccl-nvls enable-nvidia-megakernel
enable-page-major-kv-layout enable-paged-experts enable-pd-role-switch enable-pdmux
enable-precise-embedding-interpolation enable-prefill-cp enable-prefill-delayer enable-prefix-mm-cache
enable-profile-cuda-graph enable-quant-communications enable-response-store
enable-return-aux-hidden-states enable-return-indexer-topk enable-return-routed-experts
enable-scattered-sconv enable-session-radix-cache enable-shared-experts-attn-tp enable-single-batch-overlap
enable-ssl-refresh enable-streaming-session enable-strict-thinking enable-symm-mem 
enable-tokenizer-batch-encode enable-torch-compile-debug-mode enable-torch-symm-mem enable-tp-lm-head-all-to-all
enable-trace enable-two-batch-overlap enable-unified-cache-external-linker enable-unified-memory
enable-w4a4-mxfp4-megamoe enable-waterfill enable-watermark encoder-bootstrap-port
encoder-only encoder-register-urls encoder-transfer-backend encoder-urls enforce-disable-flashinfer-allreduce-fusion
enforce-shared-experts-fusion engine-info-bootstrap-port ep-dispatch-algorithm ep-num-redundant-experts
eplb-algorithm eplb-min-rebalancing-utilization-threshold eplb-rebalance-layers-per-chunk
eplb-rebalance-num-iterations expert-balancedness-report-mode expert-distribution-recorder-buffer-size
expert-distribution-recorder-mode experts-shared-outer-loras 
extra-metric-labels flashinfer-a2a-dispatch-type flashinfer-allreduce-fusion-backend
flashinfer-autotune-skip-ops flashinfer-mla-disable-ragged flashinfer-mxfp4-moe-precision flexkv-config-file
forward-hooks forward-pass-metrics-ipc-name forward-pass-metrics-worker-id fp4-gemm-backend fp8-gemm-backend
fuseep-mode gated-launch-port 
grpc-http-sidecar-port grpc-mode grpc-port grpc-response-timeout-secs 
hicache-host-memory-fraction hicache-host-memory-mode 
hicache-storage-backend-extra-config 
hicache-storage-prefetch-retry-max-attempts hicache-storage-prefetch-retry-poll-interval 
hierarchical-sparse-attention-extra-config hisparse-config
image-processor-backend init-expert-location
int8-mamba-ckpt-size kt-cpuinfer kt-max-deferred-experts-per-token kt-method kt-num-gpu-experts kt-threadpool-count
kt-weight-path kv-canary kv-canary-real-data kv-canary-sweep-interval kv-events-config language-model-only
language-only linear-attn-backend linear-attn-decode-backend linear-attn-prefill-backend
linear-attn-verify-backend linear-replayssm-cache-len lmcache-config-file load-publish-endpoint
load-snapshot-publish-interval 
lora-drain-wait-threshold lora-strict-loading lora-use-virtual-experts
mamba-backend mamba-cache-philox-rounds mamba-full-memory-ratio mamba-max-states-per-path mamba-radix-cache-strategy
mamba-ssm-dtype mamba-track-interval max-ep-size max-lora-chunk-size 
max-mamba-cache-size min-free-slots-delay mlx-enable-sampling
mm-attention-backend mm-enable-dp-encoder mm-feature-transport mm-global-cache-backend mm-io-worker-num
mm-preprocess-cache-size-mb mm-process-config mm-processor-worker-num model-checksum model-config-parser model-impl
model-loader-extra-config modelexpress-config modelopt-checkpoint-restore-path modelopt-checkpoint-save-path
modelopt-export-path modelopt-quant moe-a2a-backend moe-data-parallel-size moe-dense-tp-size moe-dp-size
moe-runner-backend monokernel-backend mooncake-ib-device msprobe-dump-config nccl-init-addr nccl-port
num-reserved-decode-tokens numa-node offload-group-size offload-mode offload-num-in-group offload-prefetch-step
optimistic-prefill-attempts otlp-service-name otlp-traces-endpoint paged-experts-num-resident pdmux-config-path
ple-offload-backend ple-offload-dir ple-offload-embedding pp-async-batch-depth pp-max-micro-batch-size pre-warm-nccl
prefill-decode-interval prefill-decode-interval-min-bs
prefill-delayer-forward-passes-buckets prefill-delayer-max-delay-ms prefill-delayer-max-delay-passes
prefill-delayer-queue-min-ratio prefill-delayer-token-usage-low-watermark prefill-delayer-wait-seconds-buckets
prefill-kv-cache-dequant-dtype prefill-only-disable-kv-cache
priority-scheduling-preemption-threshold qsa-indexer-dtype quantization-param-path
quantize-and-serve radix-cache-backend radix-eviction-policy-config remote-instance-weight-loader-backend
remote-instance-weight-loader-seed-instance-ip remote-instance-weight-loader-seed-instance-service-port
remote-instance-weight-loader-send-weights-group-ports remote-instance-weight-loader-start-seed-via-transfer-engine
return-aux-hidden-state-layer-ids return-input-ids return-output-ids
rl-on-policy-target rl-quant-profile sampling-backend sampling-mask-max-tokens
scheduler-recv-interval shared-experts-tp-size show-time-cost sidecar sidecar-args sm-group-num
smg-grpc-mode smg-http-sidecar-port spec-trace-dir
speculative-adaptive speculative-adaptive-config speculative-attention-mode
speculative-dflash-block-size speculative-domino-candidate-pool-size speculative-draft-attention-backend
speculative-draft-kv-cache-dtype speculative-draft-load-format 
speculative-draft-model-quantization speculative-draft-model-revision speculative-draft-sink-size
speculative-draft-window-size speculative-dsa-topk-backend speculative-dspark-align-verify-tokens-to-graph-tier
speculative-dspark-block-size speculative-dspark-confidence-sts-path speculative-dspark-sps-table-path
 speculative-enable-w4a4-mxfp4-megamoe speculative-moe-a2a-backend
speculative-moe-runner-backend  speculative-ngram-external-corpus-max-tokens
speculative-ngram-external-corpus-path speculative-ngram-external-sam-budget 
  
  speculative-token-map speculative-use-block-verification
speculative-use-rejection-sampling 
startup-weight-load-mode strip-thinking-cache swa-full-tokens-ratio
swa-prefix-tails tbo-token-distribution-threshold tokenizer-backend tokenizer-metrics-allowed-custom-labels
tokenizer-metrics-custom-labels-header tool-server torch-compile-max-bs trace-modules
triton-attention-num-kv-splits triton-attention-reduce-in-fp32 triton-attention-split-tile-size
trust-mm-content-hashes trust-request-chat-template unified-cache-external-linker-backend
unified-cache-external-linker-config uno-lora-path use-ray warmups
watermark-config weight-cache-mode weight-cache-socket weight-cache-timeout 
weight-loader-drop-cache-after-load weight-loader-prefetch-checkpoints weight-loader-prefetch-num-threads

""".split())
