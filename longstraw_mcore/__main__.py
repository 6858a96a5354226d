import sys

from longstraw_mcore.cli import main

if __name__ == "__main__":  # guarded: Megatron's checkpoint writer re-imports __main__
    sys.exit(main())
