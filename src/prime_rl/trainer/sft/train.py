"""The SFT trainer at the script path PRIME-RL's docs give torchrun (`torchrun ... src/prime_rl/trainer/sft/train.py`).

Not a package: a script, so PRIME-RL's lines run as written; it is asyncrl's `sft`.
"""

from asyncrl.entrypoints.sft import main

if __name__ == "__main__":
    main()
