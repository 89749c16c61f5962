"""Serving: the online loop of OnlineSpec (learn from what is served) and, later, its HTTP face."""
