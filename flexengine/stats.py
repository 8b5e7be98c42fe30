"""`python -m flexengine.stats`: kept for users; the command lives in flexengine/cli/stats.py."""

from flexengine.cli.stats import main

if __name__ == "__main__":
    main()
