"""Shared test helpers: fake and real inference servers, tiny models, cluster and job runners.

Imported as ``tests.helpers.<module>`` by the unit, integration, e2e and GPU suites and by the
benchmarks (run from the repository root). Nothing here is collected as a test.
"""
