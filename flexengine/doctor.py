"""`python -m flexengine.doctor`: kept for users; the command lives in flexengine/cli/doctor.py."""

from flexengine.cli.doctor import main

if __name__ == "__main__":
    main()
