"""Write a model family's tiny random checkpoint: ``python -m omni_transformers.tiny DIR [--family NAME]``.

The family's ``write_tiny`` writes it (default the Qwen2.5-Omni one); its weights are random
(seeded): it exists for tests, CI and a CPU demo. The Qwen2.5-Omni writer's names stay importable
from here (``write_tiny_checkpoint``, ``tiny_config``, ``tiny_tokenizer``, ``tiny_speakers``).
"""

from __future__ import annotations

import argparse
import sys

from .qwen2_5_omni.tiny import (  # noqa: F401 (the Qwen2.5-Omni writer's names, as before)
    SAMPLE_RATE,
    SPECIAL,
    SPECIAL_TOKENS,
    TOKENIZER_SPECIAL_NAMES,
    tiny_config,
    tiny_speakers,
    tiny_tokenizer,
    write_tiny_checkpoint,
)

DEFAULT_FAMILY = "qwen2_5_omni"


def main(argv=None) -> int:
    from omni_core.registry import import_ref

    from .kit.family import installed_families

    parser = argparse.ArgumentParser(prog="python -m omni_transformers.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="folder to write the checkpoint to")
    parser.add_argument("--family", default=DEFAULT_FAMILY,
                        help=f"the model family whose checkpoint to write (default {DEFAULT_FAMILY}; "
                             "omni plugins list shows the installed ones)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    families = installed_families()
    family = families.get(args.family)
    if family is None or not family.write_tiny:
        known = sorted(name for name, f in families.items() if f.write_tiny)
        parser.error(f"no installed family {args.family!r} writes a tiny checkpoint; families: {', '.join(known)}")
    path = import_ref(family.write_tiny)(args.dir, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
