"""fabricwatch.models"""
