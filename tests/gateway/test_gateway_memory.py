"""The gateway never loads torch: it tokenizes and renders chat templates only, and torch (pulled in
by AutoTokenizer's model-configuration lookup) was 220 MB of its resident memory (see
docs/results/model-sizes)."""

from __future__ import annotations

import subprocess
import sys


def test_a_gateway_with_the_reference_tokenizer_does_not_import_torch():
    probe = (
        "import sys\n"
        "from services.gateway.app import create_app\n"
        "from services.gateway.tokenizer import TargetTokenizer\n"
        "t = TargetTokenizer.load('ref')\n"
        "assert t.encode_chat([{'role': 'user', 'content': 'Grüß Gott'}])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
