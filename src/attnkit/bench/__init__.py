"""Speed and memory benchmarks (ratios measured side by side in one process)."""
