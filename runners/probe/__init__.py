"""The egress probe: proof of what a sandbox in a runner's shape can reach, in one package.

- ``checks``: what a check is and how what was seen is judged (pure; both sides use it).
- ``program``: the program that tries the checks inside a probe container (standard library
  only; its source is what the container runs).
- ``host``: running a probe on a runner host through its engine, in the runner's real shape
  (no Django: runner hosts have no database).
- ``service``: the control plane's side: ordering probes, what a runner is to try and as whom,
  recording what it reported, and whether a runner may take work.

Importing the package imports none of them.
"""
