"""``python -m gradclip_cli``: the same as the ``gradclip`` command."""

from .cli import main

if __name__ == "__main__":
    main()
