"""`gpuwarden bench`: served throughput by concurrency, with the clocks, the power and the roofline beside it.

workload.py builds the requests, client.py streams them (aiohttp), watch.py records the GPUs and the
engine's counters over each step, bound.py names what bound it (memory, compute or the host) from GPM's
activity, roofline.py computes the bandwidth ceiling, sweep.py runs the steps, and report.py prints, saves and
compares the results.
"""
