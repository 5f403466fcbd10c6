"""The RL trainer at the script path PRIME-RL's docs give torchrun (`torchrun ... src/prime_rl/trainer/rl/train.py`).

Not a package: a script, so PRIME-RL's multi-node lines run as written; it is asyncrl's `trainer`.
"""

from asyncrl.entrypoints.trainer import main

if __name__ == "__main__":
    main()
