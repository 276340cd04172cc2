"""A self-contained HTML page of one recorded update: the rubric stage per group and, for every
response token, how the rubric moved its advantage.

A token's colour is its clipped log-likelihood gap ``clip(log p(y | rubric) - log p(y), -c, c)``:
blue where reading the rubric makes the token more likely (its advantage rises by
``coef * gap``), red where it makes it less likely. Hovering a token shows its values.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np

from orsd_jax.credit import CreditRecord, GroupRecord, StepCredit

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1d1d1f; max-width: 1100px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin: 28px 0 6px; } h3 { font-size: 14px; margin: 14px 0 4px; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 4px; border-radius: 3px; }
.group { border-top: 2px solid #ccc; }
.criteria li { margin: 2px 0; } .candidates { color: #555; font-size: 12px; }
.candidates .chosen { font-weight: 600; color: #1d1d1f; }
.won, .expert { color: #0a7d28; } .lost, .detour { color: #b3261e; }
.step { margin: 6px 0 10px 16px; }
.observation { color: #555; font-size: 12px; white-space: pre-wrap; margin: 0; }
.response { font-family: ui-monospace, monospace; font-size: 13px; white-space: pre-wrap; margin: 2px 0; }
.tok { border-radius: 2px; }
.values { color: #777; font-size: 11px; }
"""


def gap_colour(gap: float, clip: float) -> str:
    """Blue for a positive gap, red for a negative one; opacity grows with |gap| up to the clip."""
    strength = float(np.clip(abs(gap) / clip, 0.0, 1.0)) if clip > 0 else 0.0
    rgb = "37, 99, 235" if gap >= 0 else "220, 38, 38"
    return f"rgba({rgb}, {0.75 * strength:.3f})"


def _tokens(step: StepCredit, clip: float) -> str:
    v = step.values
    spans = []
    for j, piece in enumerate(step.pieces):
        tip = (
            f"token {j}: {step.response_ids[j]}\ngap {v['gap'][j]:+.3f}{' (clipped)' if v['gap_clipped'][j] else ''}\n"
            f"log p with rubric {v['logp_with'][j]:.3f}, without {v['logp_without'][j]:.3f}\n"
            f"advantage {v['advantage'][j]:+.3f} -> {v['corrected'][j]:+.3f}"
        )
        style = f"background: {gap_colour(float(v['gap'][j]), clip)}"
        spans.append(f'<span class="tok" style="{style}" title="{html.escape(tip)}">{html.escape(piece)}</span>')
    return "".join(spans)


def _group(g: int, group: GroupRecord, steps: Sequence[StepCredit], clip: float) -> str:
    parts = [
        f'<section class="group"><h2>Group {g}: {html.escape(group.task)}</h2>',
        f"<p>Returns (outcome reward minus invalid-answer penalties): {', '.join(f'{r:g}' for r in group.rewards)}</p>",
    ]
    if group.chosen is not None:
        rho = group.correlations[group.chosen]
        parts.append(f'<p>Selected rubric (bundle {group.chosen}, Spearman {rho:+.3f}):</p><ol class="criteria">')
        parts += [f"<li>{html.escape(c)}</li>" for c in group.candidates[group.chosen]]
        parts.append("</ol>")
    else:
        parts.append(f"<p>No rubric: {html.escape(group.reason)}. Every token keeps its trajectory advantage.</p>")
    if group.candidates:
        parts.append('<details class="candidates"><summary>All candidate bundles</summary><ol start="0">')
        for k, (criteria, rho) in enumerate(zip(group.candidates, group.correlations)):
            label = "unparseable" if not criteria else f"Spearman {'undefined' if rho is None else f'{rho:+.3f}'}"
            body = "; ".join(html.escape(c) for c in criteria)
            parts.append(f'<li class="{"chosen" if k == group.chosen else ""}">{label}: {body}</li>')
        parts.append("</ol></details>")
    for t in sorted({s.trajectory for s in steps}):
        traj = [s for s in steps if s.trajectory == t]
        outcome = "won" if traj[0].won else "lost"
        parts.append(
            f'<h3>Trajectory {t}: <span class="{outcome}">{outcome}</span>, reward {traj[0].reward:g}, '
            f"advantage {traj[0].values['advantage'][0]:+.3f}</h3>"
        )
        for s in traj:
            v = s.values
            corrected_mean = float(np.mean(v["corrected"])) if len(v["corrected"]) else 0.0
            parts.append(
                f'<div class="step">{_observation(s)}'
                f'<div class="response" data-key="{s.group}-{s.trajectory}-{s.step}">{_tokens(s, clip)}</div>'
                f'<div class="values">mean corrected advantage {corrected_mean:+.3f}; '
                f"{int(np.sum(v['gap_clipped']))} of {len(s.pieces)} gaps clipped</div></div>"
            )
    parts.append("</section>")
    return "\n".join(parts)


# A longer observation (a WebShop results page is about 3,000 characters) is folded under its
# first line, so that the page shows the responses' tokens; the whole text is one click away.
FOLD_CHARS = 400


def _observation(step: StepCredit) -> str:
    head = f"step {step.step}{_expert_mark(step.expert)}: "
    text = step.observation
    if len(text) <= FOLD_CHARS:
        return f'<p class="observation">{head}{html.escape(text)}</p>'
    first = html.escape(text[:120].split("\n")[0])
    return (
        f'<details class="observation"><summary>{head}{first} ... ({len(text)} characters)</summary>'
        f"{html.escape(text)}</details>"
    )


def _expert_mark(expert: bool | None) -> str:
    """The planner's verdict on the step's action, when known."""
    if expert is None:
        return ""
    return (
        ' <span class="expert">(expert step)</span>' if expert else ' <span class="detour">(not an expert step)</span>'
    )


# Every text on the page is the environment's or the model's: escaped, and should anything slip
# through, no script, frame, form or remote resource runs or loads (``tests/test_credit.py``).
_CSP = (
    "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'\">"
)


def render(record: CreditRecord, clip: float, title: str = "") -> str:
    """The page for ``record``; ``clip`` is the loss's gap clip ``c`` (full colour at ``|gap| >= c``)."""
    legend = (
        f'<p class="legend">Token colour = log-likelihood gap with the rubric: '
        f'<span style="background: {gap_colour(clip, clip)}">+{clip:g} (rubric raises the token)</span>'
        f'<span style="background: {gap_colour(0.3 * clip, clip)}">+{0.3 * clip:g}</span>'
        f'<span style="background: {gap_colour(-0.3 * clip, clip)}">-{0.3 * clip:g}</span>'
        f'<span style="background: {gap_colour(-clip, clip)}">-{clip:g} (rubric lowers it)</span>. '
        "Hover a token for its values.</p>"
    )
    heading = html.escape(title or f"Per-token credit, update {record.update}")
    body = [_group(g, group, [s for s in record.steps if s.group == g], clip) for g, group in enumerate(record.groups)]
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8">{_CSP}<title>{heading}</title><style>{_STYLE}</style></head>'
        f"<body><h1>{heading}</h1>{legend}\n" + "\n".join(body) + "\n</body></html>\n"
    )
