"""The benchmarks: ``python -m benchmarks.gpu`` (the one-shot GPU run), ``benchmarks.trace_summary`` (a profile's
table), ``benchmarks.hf_baseline`` (transformers + torch at our shapes), ``benchmarks.vllm_layout`` (gpu's vllm
section: one engine per GPU); figures in ``RESULTS.md``."""
