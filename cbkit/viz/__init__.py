"""Figures: the palette, static plotly figures, live charts."""
