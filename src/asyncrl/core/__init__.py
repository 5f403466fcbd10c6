"""The bottom floor: what every other package may import and which imports nothing of asyncrl's own.

`errors` (the user-mistake exception, full-disk detection), `failpoint` (the chaos tests' kill points) and
`patches` (the register of patches of other libraries). Invariant: modules here import only the standard
library (and loguru), never another asyncrl package — `.importlinter` checks it.
"""
