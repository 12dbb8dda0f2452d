"""Benchmarks: run each with `python -m bench.<name> --help`. Every bench takes the same
`--json PATH` (its figures), `--plot PATH` (a PNG of them) and `--quick` (a smaller run),
through bench/cli.py; tests/bench/test_bench_cli.py checks each one's parser.

System benches: an engine, a server or a cluster end to end, on a workload
    bench_engine          no sharing: radixserve against transformers' static batching
    bench_prefix          shared-prefix, few-shot, multi-turn, agent-loop workloads: cache on / off / transformers
    bench_dsl             radixserve.lang programs: few-shot select, tree of thought
    bench_server          HTTP load (Poisson arrivals): throughput, TTFT and TPOT, cached against missed prefixes
    bench_latency         TTFT, inter-token gap and e2e under load across server configurations (llama.cpp beside)
    bench_step_budget     the same arrivals straight into Engine.step under each --max-step-ms
    bench_speculative     prompt-lookup speculation: decode tokens/s, acceptance, equal outputs
    bench_jump_forward    jump-forward under a grammar: steps per tool call / JSON answer, equal outputs
    bench_agents          an agent swarm over a small pool: LRU, the second tier, sessions
    bench_agent_hints     agent hints (priority, ttl_s, speculative_prefill) against none
    bench_agent_turns     agent loops with tools over HTTP: reply ids reused against re-tokenized
    bench_agent_conditions  chat agents and few-shot beside CPU-bound processes; Gemma 3's reuse (llama.cpp beside)
    bench_kv_events       step time with and without publishing KV events
    bench_dynamo_swarm    an agent swarm through NVIDIA Dynamo's frontend onto 2 workers: kv vs round-robin reuse
    bench_kv_quant        int8 KV pages: accuracy, capacity and decode step time against float32
    bench_weights         quantized weights: accuracy, speed, memory (llama.cpp beside)
    bench_hybrid_kv       hybrid KV for sliding-window models
    bench_output_path     the server's output path per token, every API, no model
    bench_cluster         replicas on Ray Serve: prefix reuse under each router
    bench_disagg          prefill/decode disaggregation: do long prompts stall running streams
    soak                  every route for minutes, two keys: nothing lost, integrity, resident memory

Kernel micro-benches: one kernel, op or model step, apart from any workload
    bench_kernels         paged attention kernels (Triton on a GPU; --cpu: the C kernels, quantized matmuls)
    bench_layer_ops       the C layer ops against eager torch and torch.compile
    bench_matmul          the decode matmuls: the skinny C kernel against oneDNN and MKL
    bench_quant_step      a real model's quantized matmuls of a step (lm head, layers), cold: two kernel builds
    bench_sliding_window  decode attention with a window against full
    bench_native_decoder  decode and mixed steps: the native decoder against the layer path
    bench_prefill         prompt tokens per second: two engine settings (attention, matmul dtype) in turns
    profile_decode        a decode step's phases (schedule, prepare, model, lm head, sample, post)
    bench_decode_floor    memory bandwidth (a triad) and each decode step's share of the floor (llama.cpp beside)
    profile_prompt        a prompt step's phases: 8 extends over cached prefixes (matmuls, attention, norms, ...)

Shared helpers: cli (the flags, JSON, Figures), harness (workload drivers, the one `percentile`),
sse (the one SSE client), report (tables, bar charts), workloads / agent_workload / dsl_workloads /
dsl_backends / kv_quant_prompts / weights_speed / gguf_kquants (what the benches above run on).
"""
