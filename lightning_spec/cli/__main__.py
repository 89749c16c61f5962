"""`python -m lightning_spec.cli ...`: the `lightning-spec` command without the console script."""

from lightning_spec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
