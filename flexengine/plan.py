"""`python -m flexengine.plan`: kept for users; the command lives in flexengine/cli/plan.py."""

from flexengine.cli.plan import cli

if __name__ == "__main__":
    cli()
