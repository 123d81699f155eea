#!/usr/bin/env python3
# The largest import cycle among the proxy's source files (proxy/src and
# proxy/crates/*/src): each file's `crate::`, `super::` and
# `portcullis_*::` paths resolved to the file of the longest module
# prefix, then the strongly connected components of that graph (Tarjan).
# Approximate (macros are not followed; the binary crate's re-exports are
# taken as the crates they name), but the same method before and after a
# change. A checkout from before the crate split (proxy/src only) works
# too.
#   python3 bench/module_cycles.py [--all] [CHECKOUT]
# With --all, every cycle, one a line (`cycle: file file ...`), after the
# summary: what tests/architecture.rs compares with the ones it allows.
import os, re, sys

args = [a for a in sys.argv[1:] if a != '--all']
top = args[0] if args else os.path.join(os.path.dirname(__file__), '..')
roots = {'portcullis': os.path.join(top, 'proxy/src')}
crates_dir = os.path.join(top, 'proxy/crates')
if os.path.isdir(crates_dir):
    for c in sorted(os.listdir(crates_dir)):
        roots['portcullis_' + c] = os.path.join(crates_dir, c, 'src')

files = {}  # (crate, rel) -> text
for crate, root in roots.items():
    for d, _, fs in os.walk(root):
        for f in fs:
            if f.endswith('.rs'):
                p = os.path.join(d, f)
                files[(crate, os.path.relpath(p, root))] = open(p).read()


def modpath(rel):
    parts = rel[:-3].split('/')
    if parts[-1] in ('mod', 'lib', 'main'):
        parts = parts[:-1]
    return parts


mods = {(crate, tuple(modpath(rel))): (crate, rel) for crate, rel in files}


def resolve(crate, parts):
    for k in range(len(parts), 0, -1):
        t = (crate, tuple(parts[:k]))
        if t in mods:
            return mods[t]
    # The binary crate names the other crates' modules through its
    # re-exports: `crate::pipeline` is portcullis_http's.
    if crate == 'portcullis' and parts:
        for other in roots:
            if other != crate and (other, (parts[0],)) in mods:
                return resolve(other, parts)
        if 'portcullis_' + parts[0] in roots:
            return resolve('portcullis_' + parts[0], parts[1:]) or mods.get(('portcullis_' + parts[0], ()))
    return None


edges = {f: set() for f in files}
for (crate, rel), src in files.items():
    here = modpath(rel)
    src = re.sub(r'//[^\n]*', '', src)
    found = []
    for m in re.finditer(r'\bcrate::((?:\w+::)*\w+)', src):
        found.append(resolve(crate, m.group(1).split('::')))
    for m in re.finditer(r'\bsuper::((?:\w+::)*\w+)', src):
        found.append(resolve(crate, here[:-1] + m.group(1).split('::')))
    for m in re.finditer(r'\b(portcullis_\w+)::((?:\w+::)*\w+)', src):
        other = m.group(1)
        if other in roots:
            found.append(resolve(other, m.group(2).split('::')) or mods.get((other, ())))
    for m in re.finditer(r'use (crate|portcullis_\w+)::\{([^}]*)\}', src):
        c = crate if m.group(1) == 'crate' else m.group(1)
        for name in re.findall(r'(\w+)(?:::|\s*[,}]|$)', m.group(2)):
            found.append(resolve(c, [name]))
    for t in found:
        if t and t != (crate, rel):
            edges[(crate, rel)].add(t)

sys.setrecursionlimit(10000)
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        sccs.append(comp)


for v in edges:
    if v not in index:
        visit(v)
big = max(sccs, key=len)
name = lambda f: f[1] if f[0] == 'portcullis' and len(roots) == 1 else f'{f[0]}/{f[1]}'
print(len(files), 'files; largest cycle:', len(big), 'files')
print(sorted(name(f) for f in big))
if '--all' in sys.argv[1:]:
    for comp in sorted(sorted(name(f) for f in c) for c in sccs if len(c) > 1):
        print('cycle:', ' '.join(comp))
