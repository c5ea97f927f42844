"""The fixed-step A/B harness of docs/results/bootstrap (run by docs/results/bootstrap/fixed-step-ab.sh; the table
"Fixed-step A/Bs on boot19's data"): `python -m services.trainer.training` with prototype
variants switched on by environment variables (they were prototyped here before the product code had
them; the product's versions are `--aux-norm` and `--ttt-ramp`, run these with `--aux-norm false`).

    AB_AUXSCALE=1   fc trains on the aux states divided by each layer's exact RMS (folded into fc after)
    AB_RAMP=R AB_STEPS=N   the unroll grows 1 -> K over the first R of the N steps
    AB_TEMP=T       soft targets softmax(logits / T)
    AB_EMA=D        export an exponential moving average (decay D) of the weights
"""

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from services.trainer.training import loop as loop_mod  # noqa: E402
from services.trainer.training import objective as objective_mod  # noqa: E402
from services.trainer.training import run as run_mod  # noqa: E402
from services.trainer.training.__main__ import main  # noqa: E402

EMA = float(os.environ.get("AB_EMA", "0"))
TEMP = float(os.environ.get("AB_TEMP", "1"))
RAMP = float(os.environ.get("AB_RAMP", "0"))
optimizers = []
real_train = run_mod.train
real_init = objective_mod.Eagle3Objective.__init__
real_forward = objective_mod.Eagle3Objective.forward


class EmaAdamW(torch.optim.AdamW):
    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.ema = [p.detach().clone() for p in self.params]
        optimizers.append(self)

    def step(self, closure=None):
        out = super().step(closure)
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.params], 1 - EMA)
        return out


def train(draft, head, data, cfg):
    s = None
    if os.environ.get("AB_AUXSCALE") == "1":
        parts = torch.cat([p.aux[p.positions > 0].float() for p in data.pieces[:400]]).unflatten(-1, (3, -1))
        rms = parts.pow(2).mean((0, 2)).sqrt()  # [3]
        print("aux layer RMS", rms.tolist(), flush=True)
        s = rms.repeat_interleave(parts.shape[-1])  # [3T]
        draft.project = lambda a: draft.fc((a.float() / s).to(draft.fc.weight.dtype))
    result = real_train(draft, head, data, cfg)
    with torch.no_grad():
        if optimizers:
            for p, e in zip(optimizers[0].params, optimizers[0].ema, strict=True):
                p.copy_(e)
        if s is not None:
            del draft.project
            draft.fc.weight.div_(s)
    return result


def init(self, draft, target_rows, *args, **kwargs):
    real_init(self, draft, target_rows / TEMP, *args, **kwargs)  # targets softmax(logits / TEMP)


calls = [0]


def forward(self, batch, unroll=None):
    if not self.draft.training:
        return real_forward(self, batch, unroll)
    K = self.ttt_steps
    k = min(K, 1 + int((K - 1) * calls[0] / (RAMP * int(os.environ["AB_STEPS"]))))
    calls[0] += 1
    return real_forward(self, batch, k)


if EMA:
    loop_mod.torch.optim.AdamW = EmaAdamW
if TEMP != 1:
    objective_mod.Eagle3Objective.__init__ = init
if RAMP:
    objective_mod.Eagle3Objective.forward = forward
run_mod.train = train
main()
