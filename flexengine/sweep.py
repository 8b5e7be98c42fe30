"""`python -m flexengine.sweep`: kept for users; the command lives in flexengine/cli/sweep.py."""

from flexengine.cli.sweep import main

if __name__ == "__main__":
    main()
