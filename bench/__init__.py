"""Benchmarks: run each with `python -m bench.<name> --help`. Every bench takes the same
`--json PATH` (its figures), `--plot PATH` (a PNG of them) and `--quick` (a smaller run),
through bench/lib/cli.py; tests/bench/test_bench_cli.py checks each one's parser.

bench/*.py are the runners, thin: each imports shared code from bench/lib/ only, never from
another runner (tests/bench/test_bench_layout.py). llama.cpp's server, where a bench runs it
beside radixserve, is found through --llama-server or the LLAMA_SERVER variable.

System benches: an engine, a server or a cluster end to end, on a workload
    bench_engine          no sharing: radixserve against transformers' static batching
    bench_prefix          shared-prefix, few-shot, multi-turn, agent-loop workloads: cache on / off / transformers
    bench_dsl             radixserve.lang programs: few-shot select, tree of thought
    bench_server          HTTP load (Poisson arrivals): throughput, TTFT and TPOT, cached against missed prefixes
    bench_latency         TTFT, inter-token gap and e2e under load across server configurations (llama.cpp beside)
    bench_step_budget     the same arrivals straight into Engine.step under each --max-step-ms
    bench_speculative     prompt-lookup speculation: decode tokens/s, acceptance, equal outputs
    bench_draft_replay    drafting replayed on recorded greedy outputs, no model: tokens a step, accepted length
    bench_jump_forward    jump-forward under a grammar: steps per tool call / JSON answer, equal outputs
    bench_agents          an agent swarm over a small pool: LRU, the second tier, sessions
    bench_agent_hints     agent hints (priority, ttl_s, speculative_prefill) against none
    bench_agent_turns     agent loops with tools over HTTP: reply ids reused against re-tokenized
    bench_agent_conditions  chat agents and few-shot beside CPU-bound processes; Gemma 3's reuse (llama.cpp beside)
    bench_recurrent_agents  agent loops on tiny recurrent models (Qwen3.5, LFM2): tokens beyond the new ones, cache off
    bench_recurrent_llamacpp  agent loops on an LFM2-350M-shaped random-weight GGUF against llama.cpp on the same file
    bench_kv_events       step time with and without publishing KV events
    bench_dynamo_swarm    an agent swarm through NVIDIA Dynamo's frontend onto 2 workers: kv vs round-robin reuse
    bench_kv_quant        int8 KV pages: accuracy, capacity and decode step time against float32
    bench_weights         quantized weights: accuracy, speed, memory (llama.cpp beside)
    bench_moe             a mixture-of-experts model's decode at batch 1 and 8 against llama.cpp on one random-weight GGUF
    bench_hybrid_kv       hybrid KV for sliding-window models: bytes per cached token; a swarm against llama.cpp
    hybrid_swarm_sim      bench_hybrid_kv's swarm on a tiny Gemma 3 and a virtual clock: reuse for a KV budget
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

The library (bench/lib/), what the runners share:
    cli            the shared flags, JSON, Figures
    workloads      the `Workload` concept and the token-session workloads (SGLang-like)
    chat_sessions  chat sessions over HTTP sharing system prompts (bench_cluster, the cluster tests)
    swarm          the agent swarm (bench_agents, bench_hybrid_kv, hybrid_swarm_sim) and its ideal reuse
    harness        engine drivers (radixserve, transformers' static batching), the one `percentile`
    servers        start a server until healthy and stop it; read /metrics and /debug/stats
    peers          llama.cpp's server (--llama-server / LLAMA_SERVER), the GGUF file of a model
    client         the one SSE client, a streamed completion as the client saw it, Poisson arrivals
    report         tables, ratio lines, bar charts
    agent_traces   agent traces for speculation: tool loops with JSON arguments, a coding agent, ReAct, chat
    draft_replay   a drafter run over recorded outputs without the model (bench_draft_replay)
    recurrent_agents  agent loops as messages on a tiny random-weight Qwen3.5 or LFM2 (bench_recurrent_agents)
    random_gguf    random-weight GGUF files of real shapes: the writer, Q4_0 blocks, a byte-level vocabulary
    dsl_workloads, dsl_backends, kv_quant_prompts, weights_speed, gguf_kquants, moe_gguf,
                   lfm2_gguf, qwen35_gguf: what single benches run on
"""
