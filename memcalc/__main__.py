"""`python -m memcalc` runs the same CLI as the `memcalc` console script."""

from memcalc.cli import main

main()
