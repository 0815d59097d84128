"""``sglang-dsv41 verify``: prove each feature on this node, the plugin's path against stock's.

For every selected check it starts the servers it needs (real ``sglang serve``
processes on 127.0.0.1, each in a process group of its own, one side of a pair
at a time on the same GPUs), sends one fixed prompt set, compares greedy tokens
and the feature's own figures, and stops them. ``plan`` says what runs,
``servers`` starts and stops processes, ``client`` holds the prompts and the
requests, ``evaluate`` compares, ``cli`` validates input and writes the report.
"""
