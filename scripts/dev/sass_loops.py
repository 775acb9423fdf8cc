"""Loops of a SASS listing (cuobjdump -sass) with their weight loads, FMAs and spills.

A loop is a backward branch and the instructions from its target to it. Prints the loops that
stream weights (LDG.E.NA: ld.global.nc.L1::no_allocate) or hold more than 8 FMAs, in address
order, with their spill loads (LDL) and stores (STL). Usage: python3 sass_loops.py FILE.sass
"""
import re
import sys

instructions = []
for line in open(sys.argv[1]):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
        instructions.append((int(m.group(1), 16), m.group(2)))

for address, text in instructions:
    target = re.search(r"BRA.*?0x([0-9a-f]+)", text)
    if not target or int(target.group(1), 16) >= address:
        continue
    start = int(target.group(1), 16)
    body = [t for a, t in instructions if start <= a <= address]
    count = lambda op: sum(op in t for t in body)
    if count("FFMA") > 8 or count("LDG.E.NA"):
        print(f"loop {start:#x}-{address:#x}: {len(body)} instructions, weight loads {count('LDG.E.NA')}, "
              f"FFMA {count('FFMA')}, spill loads {count('LDL')}, spill stores {count('STL')}")
