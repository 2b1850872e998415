"""The benchmark scenarios (one module each, exporting ``SCENARIO``) and their child-process code.

``_driver.SCENARIOS`` lists them; ``python bench/run.py --list`` prints them.
"""
