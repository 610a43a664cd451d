#!/usr/bin/env python3
"""Plots the JSON of hypic-bench-cluster as one PNG with gnuplot (Debian package gnuplot-nox).

  bench/plot_cluster.py bench/results/cluster_cpu.json bench/results/cluster_cpu.png

Panels (each only if its scenario ran): TTFT p50/p90 per mode; cold TTFT per scatter-worker count;
LPT vs round-robin; p50/p90 TTFT against the offered request rate with the SLO. Client-side TTFT, ms.
Python 3 standard library only. Exit status 1 with a message if gnuplot is missing or fails.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def q(text: str) -> str:
    """A gnuplot double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_rows(path: Path, rows: list[list]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write("\t".join(q(x) if isinstance(x, str) else f"{x:.3f}" for x in r) + "\n")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        print("plot_cluster.py: gnuplot not found (apt-get install gnuplot-nox, or scripts/setup.sh)", file=sys.stderr)
        return 1
    data = json.loads(src.read_text())
    sc = data.get("scenarios", {})
    panels = [s for s in ("modes", "scaling", "schedule", "load") if s in sc]
    if not panels:
        print(f"plot_cluster.py: {src} holds no scenario", file=sys.stderr)
        return 1
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    with tempfile.TemporaryDirectory(prefix="hypic-plot-") as tmp:
        d = Path(tmp)
        g = [f"set terminal pngcairo size {900 * cols},{560 * rows} font 'Sans,10'",
             f"set output {q(str(out))}",
             f"set multiplot layout {rows},{cols} title {q('hypic cluster benchmark, ' + data['date_utc'][:10] + ', ' + data['host']['cpu'] + ' (' + str(data['host']['cores']) + ' cores)')}",
             "set grid ytics", "set key top center horizontal", "set style fill solid 0.8 border -1"]
        if "modes" in sc:
            m = sc["modes"]
            write_rows(d / "modes.dat", [[r["name"], r["ttft_ms"]["p50"], r["ttft_ms"]["p90"]] for r in m["rows"]])
            g += ["set style data histogram", "set style histogram clustered gap 1", "set boxwidth 0.9",
                  "set logscale y", "set ylabel 'TTFT (ms, log scale)'",
                  f"set yrange [{0.5 * min(r['ttft_ms']['p50'] for r in m['rows']):.3g}:{4 * max(r['ttft_ms']['p90'] for r in m['rows']):.3g}]", "set xtics rotate by -25 noenhanced",
                  f"set title {q('TTFT per mode, same prompts (' + str(m['scatter_workers']) + ' scatter workers)')}",
                  f"plot {q(str(d / 'modes.dat'))} using 2:xtic(1) title 'p50', '' using 3 title 'p90'",
                  "unset logscale y", "set xtics norotate", "set autoscale y"]
        if "scaling" in sc:
            s = sc["scaling"]
            write_rows(d / "scaling.dat", [[str(r["scatter_workers"]), r["ttft_ms"]["p50"], r["ttft_ms"]["p90"],
                                            r["server_ttft_ms_mean"]["scatter"]] for r in s["rows"]])
            g += ["set style data histogram", "set style histogram clustered gap 1", "set boxwidth 0.9",
                  "set ylabel 'ms'", "set xlabel 'scatter workers'",
                  f"set yrange [0:{1.3 * max(r['ttft_ms']['p90'] for r in s['rows']):.0f}]",
                  f"set title {q('all-cold TTFT vs scatter workers (' + str(s['segments_per_prompt']) + ' segments x ' + str(s['segment_tokens']) + ' tokens)')}",
                  f"plot {q(str(d / 'scaling.dat'))} using 2:xtic(1) title 'TTFT p50', '' using 3 title 'TTFT p90', "
                  "'' using 4 title 'scatter phase (mean)'", "unset xlabel", "set autoscale y"]
        if "schedule" in sc:
            s = sc["schedule"]
            write_rows(d / "schedule.dat", [[r["policy"], r["ttft_ms"]["p50"], r["ttft_ms"]["p90"],
                                             r["server_ttft_ms_mean"]["scatter"]] for r in s["rows"]])
            g += ["set style data histogram", "set style histogram clustered gap 1", "set boxwidth 0.9",
                  "set ylabel 'ms'", f"set yrange [0:{1.3 * max(r['ttft_ms']['p90'] for r in s['rows']):.0f}]",
                  f"set title {q('LPT vs round-robin, uneven segments (' + str(s['long_tokens']) + '/' + str(s['short_tokens']) + ' tokens, ' + str(s['scatter_workers']) + ' workers)')}",
                  f"plot {q(str(d / 'schedule.dat'))} using 2:xtic(1) title 'TTFT p50', '' using 3 title 'TTFT p90', "
                  "'' using 4 title 'scatter phase (mean)'", "set autoscale y"]
        if "load" in sc:
            s = sc["load"]
            write_rows(d / "load.dat", [[r["offered_rate"], r["ttft_ms"]["p50"], r["ttft_ms"]["p90"]]
                                        for r in s["rows"]])
            slo = s["slo_p90_ttft_ms"]
            best = s.get("max_rate_meeting_slo")
            g += ["set style data linespoints", "set xlabel 'offered request rate (req/s, Poisson)'",
                  "set ylabel 'TTFT (ms)'", "set logscale x 2", "set offsets graph 0.05, graph 0.05, 0, 0",
                  f"set yrange [0:{1.15 * max([slo] + [r['ttft_ms']['p90'] for r in s['rows']]):.0f}]",
                  f"set title {q('sustained load: TTFT vs offered rate; best rate within SLO: ' + (f'{best:g} req/s' if best is not None else 'none'))}",
                  f"plot {q(str(d / 'load.dat'))} using 1:2 title 'p50' lw 2 pt 7, '' using 1:3 title 'p90' lw 2 pt 5, "
                  f"{slo} title 'SLO (p90)' dt 2 lw 2 lc rgb 'red'",
                  "unset logscale x", "unset xlabel", "set autoscale y", "set offsets 0, 0, 0, 0"]
        g.append("unset multiplot")
        script = d / "plot.gp"
        script.write_text("\n".join(g) + "\n")
        r = subprocess.run([gnuplot, str(script)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"plot_cluster.py: gnuplot failed:\n{r.stderr}", file=sys.stderr)
            return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
