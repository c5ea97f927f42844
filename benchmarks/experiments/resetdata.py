"""Copy a bootstrap's data to a new --out with its training reset (the training-only reruns of
docs/results/bootstrap: boot17g/h/i, boot18a/n).

    python resetdata.py SRC DST [--keep-train N --generate-s S] [fixed_key=json ...]

`--keep-train N` keeps the first N training chunks (in the order generation finished them) and
charges S seconds to generation: the data a shorter generation phase would have produced. Rerun
`tide draft bootstrap` with the same prompts, `--out DST` and a matching `--gen-fraction`.
"""

import json
import shutil
import sys
from pathlib import Path


def main(args: list[str]) -> None:
    src, dst = Path(args.pop(0)), Path(args.pop(0))
    m = json.loads((src / "bootstrap.json").read_text())
    if args and args[0] == "--keep-train":
        m["chunks"]["train"] = m["chunks"]["train"][: int(args[1])]
        m["spent_s"]["generate"] = float(args[3])
        args = args[4:]
    (dst / "chunks" / "train").mkdir(parents=True)
    shutil.copytree(src / "chunks" / "eval", dst / "chunks" / "eval")
    for name in m["chunks"]["train"]:
        shutil.copy(src / "chunks" / "train" / name, dst / "chunks" / "train" / name)
    m["train"] = {"schedule_steps": None, "curve": [], "history": []}
    m["done"] = False
    for k in ("train", "eval", "other"):
        m["spent_s"][k] = 0.0
    for kv in args:
        k, v = kv.split("=")
        m["fixed"][k] = json.loads(v)
    (dst / "bootstrap.json").write_text(json.dumps(m, indent=1))
    print(m["spent_s"], len(m["chunks"]["train"]), m["fixed"])


if __name__ == "__main__":
    main(sys.argv[1:])
