"""`python -m flexengine.train`: kept for users; the command lives in flexengine/cli/train.py."""

from flexengine.cli.train import main

if __name__ == "__main__":
    main()
