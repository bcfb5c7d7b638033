"""Protobuf <-> domain conversions, one module per message family.

`selection` (deployment specs, platforms, decisions, the measured policy's answers),
`conversion` (ConvertWeights' headers, tensor streams, progress and summaries), `run`
(RunMoE's request and its hand-encoded reply), `workers` (ListWorkers, GetPlatform,
ListLayers), `upgrade` (DiffRulesets' answers under several rulesets and their
differences) and `answer_cache` (SelectBackend's whole answers kept as bytes). The servicer
calls these on its way in and out of the data plane; nothing else crosses the edge.
"""
