#!/usr/bin/env bash
# The GTO and Draft-OPD acceptance runs (issues 15 and 16), alone on the machine, resumable.
#   experiments/gto-draft-opd/scripts/objectives_acceptance.sh BASELINE_DRAFTER_DIR TREE [MINUTES] [OUT]
# 1. trains, from the same baseline drafter and at the same RunBudget minutes, one after another:
#    GTO, its continued-SFT control, Draft-OPD and its SFT-on-rollouts control, then the ablations
#    (GTO: mean, max, no debiasing, m = 1; Draft-OPD: gamma 1, all-forward, all-reverse, random
#    anchors), every drafter copied out with its sha256 (`lightning-spec bench compare`);
# 2. benches the baseline and the four main drafters side by side in one run at T = 0 on all 80
#    MT-Bench and all 164 HumanEval prompts with TREE (the tree GTO trained for), then at T = 1.
# Each step skips what an earlier, killed invocation finished.
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:?baseline drafter folder}
TREE=${2:?tree spec, e.g. dynamic:2,8,8}
MINUTES=${3:-30}
OUT=${4:-$HOME/.cache/lightning-spec/compare/objectives}
LS=.venv/bin/lightning-spec
$LS bench compare --baseline "$BASE" --minutes "$MINUTES" --out "$OUT" \
  "gto=experiments/gto-draft-opd/configs/gto_on_dataset.yaml --model.init_args.tree=$TREE" \
  "sft_control=experiments/gto-draft-opd/configs/control_sft_continue.yaml" \
  "draft_opd=experiments/gto-draft-opd/configs/draft_opd_on_policy.yaml --data.init_args.rollout_tree=$TREE" \
  "opd_sft_control=experiments/gto-draft-opd/configs/control_sft_same_rollouts.yaml --data.init_args.rollout_tree=$TREE"
$LS bench compare --baseline "$BASE" --minutes "$MINUTES" --out "$OUT" \
  "gto_mean=experiments/gto-draft-opd/configs/gto_on_dataset.yaml --model.init_args.tree=$TREE --model.init_args.aggregation=mean" \
  "gto_max=experiments/gto-draft-opd/configs/gto_on_dataset.yaml --model.init_args.tree=$TREE --model.init_args.aggregation=max" \
  "gto_no_debias=experiments/gto-draft-opd/configs/gto_on_dataset.yaml --model.init_args.tree=$TREE --model.init_args.debias=false" \
  "gto_m1=experiments/gto-draft-opd/configs/gto_on_dataset.yaml --model.init_args.tree=$TREE --model.init_args.group_size=1 --model.init_args.groups=16" \
  "opd_gamma1=experiments/gto-draft-opd/configs/draft_opd_on_policy.yaml --data.init_args.rollout_tree=$TREE --model.init_args.gamma=1.0" \
  "opd_forward=experiments/gto-draft-opd/configs/draft_opd_on_policy.yaml --data.init_args.rollout_tree=$TREE --model.init_args.lambda_rejected=0" \
  "opd_reverse=experiments/gto-draft-opd/configs/draft_opd_on_policy.yaml --data.init_args.rollout_tree=$TREE --model.init_args.lambda_accepted=0" \
  "opd_random=experiments/gto-draft-opd/configs/draft_opd_on_policy.yaml --data.init_args.rollout_tree=$TREE --model.init_args.anchors=random"
for T in 0.0 1.0; do
  RESULT="$OUT/bench_T$T.json"
  [ -f "$RESULT" ] && continue
  .venv/bin/lightning-spec bench --drafter "$BASE" --drafter "$OUT/gto/drafter" \
    --drafter "$OUT/sft_control/drafter" --drafter "$OUT/draft_opd/drafter" \
    --drafter "$OUT/opd_sft_control/drafter" --dataset mtbench,humaneval --max-new-tokens 64 \
    --tree "$TREE" --temperature "$T" --prepack --methods hf_generate,speculative \
    --no-progress --output "$RESULT"
done
echo "results in $OUT (summary.json per training batch, bench_T*.json)"
