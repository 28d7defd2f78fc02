"""fabricwatch.actions"""
