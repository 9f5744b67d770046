"""``python -m bench [--quick] [--scenario NAME] [--out DIR]``: see bench/runner.py."""

if __name__ == "__main__":
    import sys

    from bench.runner import main

    sys.exit(main())
