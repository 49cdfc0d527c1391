"""HTML reports that render offline: plotly.js once, before the first pscluster figure.

pscluster's figures (the dashboard's, ``compare``'s, ``Cluster.plan``'s) leave plotly.js out of the
notebook: in JupyterLab the page loads it from the pscluster server extension. A report opened from disk
has no server, so the HTML export carries the library once::

    jupyter nbconvert --to html --execute --HTMLExporter.preprocessors=pscluster.report.InlinePlotly nb.ipynb

(``make demo`` does this). The preprocessor changes only the exported copy, never the notebook.
"""

from __future__ import annotations

import pathlib

import plotly
from nbconvert.preprocessors import Preprocessor

FIGURE_MARK = "drawStatic(div, "  # in every static pscluster figure (widgets.live.STATIC_CALL)


def plotly_script() -> str:
    """plotly.js as one script element."""
    source = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return f"<script type='text/javascript'>{source.read_text(encoding='utf-8')}</script>"


class InlinePlotly(Preprocessor):
    """Puts plotly.js into the first HTML output that holds a pscluster figure, and nowhere else."""

    def preprocess(self, nb, resources):
        for cell in nb.cells:
            for output in cell.get("outputs", []):
                text = output.get("data", {}).get("text/html")
                if text is None:
                    continue
                text = "".join(text) if isinstance(text, list) else text
                if FIGURE_MARK in text:
                    output["data"]["text/html"] = plotly_script() + text
                    return nb, resources
        return nb, resources
