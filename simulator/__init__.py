"""fabricwatch.simulator: the simulated GPU cluster (the world model behind `fabricwatch simulate`,
`fabricwatch eval`, bench/ and the tests)."""
