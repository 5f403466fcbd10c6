"""The verifiers adapter: load environments, sample their prompts, run their rollout groups.

`loading` finds and loads an environment by id; `mixture` samples prompts across several; `runners` runs a
slot's groups, through `v1` (verifiers v1 episodes: in process, `direct`, or in an env server, `served` /
`server`) or `classic` (verifiers < 0.4's client, `coalesce` merging a group's identical requests). The
rest of the orchestrator sees rollout outputs only, never verifiers' objects.
"""
