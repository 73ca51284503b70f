#!/usr/bin/env bash
# The probe on a GPU: NCCL with t=1, and rank 0 of t=8 through torch's fake
# process group, for a few knob sets, each compared with `estimate --exact`
# (norm statistics in fp32, as CUDA keeps them) and reporting torch.cuda's
# allocated and peak bytes around the forward pass. CI never runs this: it is
# for a machine with an NVIDIA GPU and torch installed.
set -u
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
check() {
    echo "== memcalc measure $*"
    python -m memcalc measure --config tiny --device cuda "$@" || status=1
}
while read -r knobs; do
    # shellcheck disable=SC2086  # the knob string is meant to split into flags
    check --t 1 --backend nccl --launch spawn --strategy tp $knobs
    # shellcheck disable=SC2086
    check --t 8 --launch fake --strategy tp-sp $knobs
done <<'KNOBS'
--dropout 0.1
--mlp swiglu --num-query-groups 8 --norm rmsnorm --attention flash --dropout 0
--recompute selective --dtype fp16
--recompute full
KNOBS
exit $status
