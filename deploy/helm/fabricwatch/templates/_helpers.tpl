{{/* Names, labels and shared pieces of the fabricwatch chart. */}}

{{- define "fabricwatch.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "fabricwatch.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "fabricwatch.selector" (list . "gateway") */}}
{{- define "fabricwatch.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "fabricwatch.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "fabricwatch.gatewayTarget" -}}
{{- printf "%s-gateway.%s.svc:%d" (include "fabricwatch.fullname" .) .Release.Namespace (int .Values.gateway.port) -}}
{{- end -}}

{{- define "fabricwatch.gatewayCASecret" -}}
{{- default .Values.gateway.tls.secretName .Values.collector.gatewayCASecret.name -}}
{{- end -}}

{{/* Pod-level settings every fabricwatch pod shares. */}}
{{- define "fabricwatch.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Scheduling of one component: include "fabricwatch.scheduling" .Values.gateway */}}
{{- define "fabricwatch.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* --metrics-listen args of one component: include "fabricwatch.metricsArgs" (list . "gateway") */}}
{{- define "fabricwatch.metricsArgs" -}}
{{- $root := index . 0 -}}
{{- $port := index $root.Values.metrics.ports (index . 1) -}}
- --metrics-listen
- {{ printf "0.0.0.0:%d" (int $port) | quote }}
- --metrics-allow-remote
{{- end -}}

{{- define "fabricwatch.metricsPort" -}}
{{- $root := index . 0 -}}
- {name: metrics, containerPort: {{ index $root.Values.metrics.ports (index . 1) }}, protocol: TCP}
{{- end -}}

{{- define "fabricwatch.metricsAnnotations" -}}
{{- $root := index . 0 -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index $root.Values.metrics.ports (index . 1) | quote }}
prometheus.io/path: /metrics
{{- end -}}
