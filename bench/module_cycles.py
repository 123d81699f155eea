#!/usr/bin/env python3
# The largest import cycle among proxy/src's files: each file's `crate::`
# and `super::` paths resolved to the file of the longest module prefix,
# then the strongly connected components of that graph (Tarjan).
# Approximate (macros and re-exports are not followed), but the same
# method before and after a change.
#   python3 bench/module_cycles.py [CHECKOUT]
import os,re,sys
root=(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), '..'))+'/proxy/src'
files={}
for d,_,fs in os.walk(root):
    for f in fs:
        if f.endswith('.rs'):
            p=os.path.join(d,f); rel=os.path.relpath(p,root)
            files[rel]=open(p).read()
def modpath(rel):
    parts=rel[:-3].split('/')
    if parts[-1] in ('mod','lib','main'): parts=parts[:-1]
    return parts
mods={tuple(modpath(r)):r for r in files}
def resolve(parts):
    # longest prefix that is a module file
    for k in range(len(parts),0,-1):
        t=tuple(parts[:k])
        if t in mods: return mods[t]
    return None
edges={r:set() for r in files}
for rel,src in files.items():
    here=modpath(rel)
    src=re.sub(r'//[^\n]*','',src)
    for m in re.finditer(r'crate::((?:\w+::)*\w+)',src):
        t=resolve(m.group(1).split('::'))
        if t and t!=rel: edges[rel].add(t)
    for m in re.finditer(r'\bsuper::((?:\w+::)*\w+)',src):
        base=here[:-1] if not rel.endswith('mod.rs') else here[:-1]
        t=resolve(base+m.group(1).split('::'))
        if t and t!=rel: edges[rel].add(t)
    for m in re.finditer(r'use crate::\{([^}]*)\}',src):
        for name in re.findall(r'(\w+)(?:::|\s*[,}]|$)',m.group(1)):
            t=resolve([name])
            if t and t!=rel: edges[rel].add(t)
# tarjan
sys.setrecursionlimit(10000)
index={};low={};stack=[];on=set();sccs=[];i=[0]
def sc(v):
    index[v]=low[v]=i[0];i[0]+=1;stack.append(v);on.add(v)
    for w in edges[v]:
        if w not in index: sc(w); low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],index[w])
    if low[v]==index[v]:
        comp=[]
        while True:
            w=stack.pop();on.discard(w);comp.append(w)
            if w==v:break
        sccs.append(comp)
for v in edges:
    if v not in index: sc(v)
big=max(sccs,key=len)
print(len(files),"files; largest cycle:",len(big),"files");print(sorted(big))
