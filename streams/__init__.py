"""fabricwatch.streams"""
