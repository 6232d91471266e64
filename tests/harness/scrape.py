"""A /metrics page read by prometheus_client's own parser: each sample's value by its name and its label values, in
the order the page writes them (a gauge without labels: the key ()). For the joules tests and
benchmarks/joules_conservation.py."""

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[str, dict[tuple[str, ...], float]]:
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sample.labels.values())] = sample.value
    return out
