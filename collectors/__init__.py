"""fabricwatch.collectors"""
