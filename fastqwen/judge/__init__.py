"""The judge: runs an engine the way the platform does, with the native baseline in the same run.

Modules, in the order a run touches them: `cli` (arguments, input checks), `probe` (device and
ceilings), `runner` (the trusted parent, per workload), `process` (one engine process: pipes,
timestamps, timeouts), `child` (the engine-side harness), `prompts`,
`replay` (teacher-forced correctness check), `gates` (codes and score), `roofline`,
`report` (table and JSON), `chart` (PNG).
"""
