"""``python -m gaugeopt`` runs the command line (:mod:`gaugeopt.tools.cli`)."""

from gaugeopt.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
