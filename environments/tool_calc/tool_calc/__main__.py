"""`python -m tool_calc --sft-out FILE --n N`: write SFT warm-up data."""

import sys

from tool_calc import main

sys.exit(main())
