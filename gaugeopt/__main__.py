"""``python -m gaugeopt`` runs the command line (:mod:`gaugeopt.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
