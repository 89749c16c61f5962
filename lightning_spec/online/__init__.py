"""OnlineSpec: the drafter keeps learning from what it serves (docs/methods/onlinespec.md).

- `loop`: the learning loop (`run_stream`): serve a round, read the verification feedback,
  update, guard (`SafetyGuard`), publish, checkpoint.
- `strategies`: what learns between rounds (`make_strategy`: frozen, ogd, optimistic, ensemble,
  osd, dpo), with `losses` (feedback batches and the online losses) and `vocab` (the
  draft-vocabulary swap).
- `stream`, `continuations`, `overlap`, `hindsight`, `beside`: the request stream, its cached
  greedy answers, the stream-vs-training-set check, the hindsight split and updates in a
  worker thread beside serving.
- `engines`, `vllm_engine`, `vllm_draft`, `vllm_worker`, `http`: the faces it serves through
  (our decoder, a running vLLM engine with its all-or-nothing drafter push, an HTTP server).
"""
