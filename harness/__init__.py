"""dtbench core (``dtbench.harness``): suites, data, models, registry, runner, measurement, database."""
