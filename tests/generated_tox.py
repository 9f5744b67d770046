"""Run a generated plugin's own tox the way its README says where no index has omni-core: with
``OMNI_CORE`` set to this checkout and nothing else of the caller's (no other ``OMNI_*``,
``PIP_CONSTRAINT``, ``TOX_*`` or venv variables). One env (this Python, the installed omni-core),
not the matrix. Then check what it installed: omni-core, and the torch release its
``constraints.txt`` pins, with no NVIDIA or CUDA package (this machine's pip finds the CPU build
in a local folder of wheels: what the README's PIP_FIND_LINKS / extra index do elsewhere).

    python tests/generated_tox.py omni-tmplstage

Run by the plugin-template tox env (tox.ini); exits non-zero with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import json, re
from importlib import metadata
import torch, omni_core
names = sorted(d.metadata["Name"] for d in metadata.distributions())
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "omni_core": omni_core.__version__,
                  "gpu_packages": [n for n in names if re.match(r"nvidia|.*cuda|triton", n.lower())]}))
"""


def main(project: str) -> None:
    root = Path(project).resolve()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMNI_", "TOX_")) and k not in ("PIP_CONSTRAINT", "VIRTUAL_ENV", "PYTHONPATH")}
    env["OMNI_CORE"] = str(Path(__file__).resolve().parent.parent)
    name = f"py{sys.version_info[0]}{sys.version_info[1]}-omniinstalled"
    print(f"$ OMNI_CORE={env['OMNI_CORE']} tox -e {name}   (in {root}, no other OMNI_*, no PIP_CONSTRAINT)", flush=True)
    tox = subprocess.run([sys.executable, "-m", "tox", "-e", name], cwd=root, env=env, timeout=1200)
    if tox.returncode:
        sys.exit(f"the generated tox env {name} failed (exit {tox.returncode}) with only OMNI_CORE set")
    python = root / ".tox" / name / "bin" / "python"
    done = subprocess.run([str(python), "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        sys.exit(f"could not inspect {python}:\n{done.stderr}")
    found = json.loads(done.stdout)
    print(f"installed by the generated tox: {found}")
    pinned = (root / "constraints.txt").read_text().split("torch==", 1)[1].split()[0]
    if found["gpu_packages"] or found["cuda"] is not None or found["torch"].split("+")[0] != pinned:
        sys.exit(f"the generated tox installed torch {found['torch']} (CUDA {found['cuda']}) and "
                 f"{found['gpu_packages'] or 'no GPU packages'}: expected the pinned CPU torch {pinned} and none")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/generated_tox.py GENERATED_PLUGIN_FOLDER")
    main(sys.argv[1])
