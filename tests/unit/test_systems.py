"""The table of real machines a plan is made for: sourced figures, datasheet peaks, lookup and overrides."""

import dataclasses

import pytest

from meshtrain.errors import MeshtrainError
from meshtrain.machine.datasheet import match_device
from meshtrain.plan import systems
from meshtrain.plan.systems import FIGURES, SYSTEMS, PlanError, System, custom, get, names

GiB = 2**30
T = 1e12
REQUIRED = ["polaris", "perlmutter", "perlmutter-80", "aurora", "frontier", "dgx-h100"]


def test_the_table_holds_the_machines_the_planner_promises():
    assert set(REQUIRED) <= set(names())
    assert names() == list(SYSTEMS)
    assert all(SYSTEMS[name].name == name for name in names())


def test_figures_are_every_field_but_the_labels():
    """A new figure field must join FIGURES, or it could be added without a source."""
    labels = {"name", "title", "sources", "note", "scheduler"}  # SchedulerFacts carry their own source
    assert set(FIGURES) == {f.name for f in dataclasses.fields(System)} - labels


@pytest.mark.parametrize("name", REQUIRED)
def test_every_figure_has_a_source(name):
    system = get(name)
    for figure in FIGURES:
        source = system.sources.get(figure)
        assert isinstance(source, str) and len(source) > 20, f"{name}.{figure}: {source!r}"
    # Derived figures say how they were derived; the network share names its arithmetic.
    assert system.sources["inter_node_gbs"].startswith("derived:")
    assert "/" in system.sources["inter_node_gbs"]


def test_a_system_without_a_source_for_a_figure_is_refused():
    polaris = get("polaris")
    sources = dict(polaris.sources)
    del sources["intra_node_gbs"]
    with pytest.raises(PlanError, match="intra_node_gbs"):
        dataclasses.replace(polaris, sources=sources)


@pytest.mark.parametrize("name", REQUIRED)
def test_peaks_are_the_datasheet_entry_of_the_device(name):
    system = get(name)
    entry = match_device(system.device)
    assert entry is not None
    assert dict(system.peak_flops) == dict(entry.flops)
    assert set(system.peak_flops) == {"bf16", "fp16", "tf32", "fp32"}
    assert entry.source in system.sources["peak_flops"]


def test_peaks_per_torch_device():
    assert get("polaris").peak_flops["bf16"] == 312 * T
    assert get("perlmutter-80").peak_flops["tf32"] == 156 * T
    assert get("dgx-h100").peak_flops["bf16"] == 989.4 * T
    assert get("frontier").peak_flops["bf16"] == 191.5 * T  # one GCD: half the 383 TFLOP/s package
    assert get("frontier").peak_flops["tf32"] is None  # MI200 has no tf32 path
    assert get("aurora").peak_flops["bf16"] == 419.4 * T  # one stack: half the 839 TFLOP/s card


def test_devices_and_memory_per_torch_device():
    frontier = get("frontier")
    assert frontier.devices_per_node == 8  # 4 MI250X x 2 GCDs
    assert frontier.device_memory_bytes == 64 * GiB  # GiB multiples: 128 GB per package / 2 GCDs
    aurora = get("aurora")
    assert aurora.devices_per_node == 12  # 6 Max 1550 x 2 stacks, FLAT mode
    assert aurora.devices_per_node * aurora.device_memory_bytes == 768 * GiB  # ALCF: 768 GiB HBM per node
    assert get("polaris").device_memory_bytes == 40 * GiB
    assert get("perlmutter").device_memory_bytes == 40 * GiB
    assert get("perlmutter-80").device_memory_bytes == 80 * GiB
    assert get("dgx-h100").devices_per_node * get("dgx-h100").device_memory_bytes == 640 * GiB
    assert all(s.device_memory_bytes % GiB == 0 for s in SYSTEMS.values())


def test_network_share_is_nics_times_rate_over_devices():
    assert get("polaris").inter_node_gbs == 2 * 25 / 4 == 12.5
    assert get("perlmutter").inter_node_gbs == 4 * 25 / 4
    assert get("aurora").inter_node_gbs == pytest.approx(8 * 25 / 12)
    assert get("frontier").inter_node_gbs == 4 * 25 / 8
    assert get("dgx-h100").inter_node_gbs == 8 * 50 / 8


def test_achievable_intra_node_bandwidth_is_below_the_links_peak():
    assert get("polaris").intra_node_gbs == 0.8 * 300 < 300  # NVLink-3: 300 GB/s per direction per A100
    assert get("dgx-h100").intra_node_gbs == 370 < 450  # NVLink-4: 450 GB/s per direction per H100
    assert get("frontier").intra_node_gbs == 0.8 * 100  # two Infinity Fabric links between packages
    assert "measured" in get("aurora").sources["intra_node_gbs"]


def test_latencies_are_per_ring_step_and_reproduce_nccls_estimate():
    """Counting a ring all-reduce's 2(n-1) steps of the per-step latency gives NCCL's own estimate."""
    polaris = get("polaris")
    assert 2 * 3 * polaris.intra_node_latency_s == pytest.approx((6.6 + 6 * 0.6) * 1e-6)  # 4 GPUs: 10.2 us
    # Two nodes of 4 (AMD CPUs): 14 steps, 4 of them over the network at 2.7 us, 10 at AMD's 2.0 us.
    assert 14 * polaris.inter_node_latency_s == pytest.approx((6.6 + 10 * 2.0 + 4 * 2.7) * 1e-6)
    dgx = get("dgx-h100")  # Intel CPUs: NCCL's network overhead is 1.0 us
    assert 30 * dgx.inter_node_latency_s == pytest.approx((6.6 + 26 * 1.0 + 4 * 2.7) * 1e-6)
    for system in SYSTEMS.values():
        assert 0 < system.intra_node_latency_s < system.inter_node_latency_s < 1e-5
        assert "per step" in system.sources["intra_node_latency_s"]
    assert "stand-in" in get("frontier").sources["intra_node_latency_s"]
    assert "stand-in" in get("aurora").sources["inter_node_latency_s"]
    assert "stand-in" not in dgx.sources["intra_node_latency_s"]


def test_host_memory_per_node():
    assert get("polaris").host_memory_bytes == 512 * GiB
    assert get("perlmutter").host_memory_bytes == 256 * GiB
    assert get("aurora").host_memory_bytes == 1024 * GiB
    assert get("frontier").host_memory_bytes == 512 * GiB
    assert get("dgx-h100").host_memory_bytes == 2048 * GiB


def test_perlmutter_says_which_nodes_it_describes():
    assert "80GB" in get("perlmutter-80").device and "40GB" in get("perlmutter").device
    assert "perlmutter-80" in get("perlmutter").note


def test_systems_are_read_only():
    polaris = get("polaris")
    with pytest.raises(dataclasses.FrozenInstanceError):
        polaris.intra_node_gbs = 1.0
    with pytest.raises(TypeError):
        polaris.peak_flops["bf16"] = 1.0
    with pytest.raises(TypeError):
        polaris.sources["device"] = "rumour"
    with pytest.raises(TypeError):
        SYSTEMS["mine"] = polaris


def test_get_ignores_case_and_surrounding_space():
    assert get("Polaris") is SYSTEMS["polaris"]
    assert get("  DGX-H100 ") is SYSTEMS["dgx-h100"]
    assert get("PERLMUTTER-80") is SYSTEMS["perlmutter-80"]


def test_an_unknown_system_names_the_known_ones_and_the_ways_out():
    with pytest.raises(PlanError) as caught:
        get("summit")
    message = str(caught.value)
    assert "'summit'" in message
    for name in names():
        assert name in message
    for way_out in ("`this`", "--device-memory", "--intra-node-bw", "--inter-node-bw"):
        assert way_out in message
    assert isinstance(caught.value, MeshtrainError) and isinstance(caught.value, ValueError)


def test_custom_replaces_exactly_the_given_figures_and_marks_them():
    base = get("polaris")
    mine = custom(base, device_memory_gib=80, intra_node_gbs=100)
    assert mine.device_memory_bytes == 80 * GiB
    assert mine.intra_node_gbs == 100.0
    changed = {"device_memory_bytes", "intra_node_gbs"}
    for figure in FIGURES:
        if figure in changed:
            assert mine.sources[figure] == "given on the command line"
        else:
            assert getattr(mine, figure) == getattr(base, figure)
            assert mine.sources[figure] == base.sources[figure]
    assert (mine.name, mine.title, mine.note) == (base.name, base.title, base.note)
    assert get("polaris") is base and base.device_memory_bytes == 40 * GiB  # the table is untouched


def test_custom_can_replace_every_overridable_figure():
    mine = custom(get("frontier"), device_memory_gib=0.5, intra_node_gbs=50, inter_node_gbs=25.5,
                  devices_per_node=4)
    assert (mine.device_memory_bytes, mine.intra_node_gbs, mine.inter_node_gbs, mine.devices_per_node) == (
        GiB // 2, 50.0, 25.5, 4)
    assert {f for f in FIGURES if mine.sources[f] == "given on the command line"} == {
        "device_memory_bytes", "intra_node_gbs", "inter_node_gbs", "devices_per_node"}
    assert custom(get("frontier")) == get("frontier")  # nothing given: nothing changes


@pytest.mark.parametrize("given, flag", [
    ({"device_memory_gib": 0}, "--device-memory"),
    ({"intra_node_gbs": -1.0}, "--intra-node-bw"),
    ({"inter_node_gbs": float("nan")}, "--inter-node-bw"),
    ({"inter_node_gbs": float("inf")}, "--inter-node-bw"),
    ({"intra_node_gbs": True}, "--intra-node-bw"),
    ({"devices_per_node": 0}, "devices per node"),
    ({"devices_per_node": 2.5}, "devices per node"),
])
def test_custom_refuses_figures_that_are_not_positive(given, flag):
    with pytest.raises(PlanError, match=flag):
        custom(get("polaris"), **given)


def test_every_device_in_the_table_is_in_the_datasheet():
    """_peak_flops fails loudly for a device the datasheet lacks, rather than planning with no peak."""
    with pytest.raises(PlanError, match="no datasheet entry"):
        systems._peak_flops("Imaginary Accelerator 9000")
