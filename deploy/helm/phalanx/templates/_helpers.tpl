{{/* Chart name, overridable. */}}
{{- define "phalanx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; the release name alone when it already contains the chart name. */}}
{{- define "phalanx.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "phalanx.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "phalanx.labels" -}}
helm.sh/chart: {{ include "phalanx.chart" . }}
{{ include "phalanx.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "phalanx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "phalanx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "phalanx.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The NATS URL workers use: the bundled server's Service, or the external one. */}}
{{- define "phalanx.natsUrl" -}}
{{- if .Values.nats.bundled.enabled }}
{{- printf "nats://%s-nats:4222" (include "phalanx.fullname" .) }}
{{- else }}
{{- required "nats.url is required unless nats.bundled.enabled" .Values.nats.url }}
{{- end }}
{{- end }}

{{/* The etcd host:port workers use: the bundled member's Service, or the external one. */}}
{{- define "phalanx.etcdEndpoint" -}}
{{- if .Values.etcd.bundled.enabled }}
{{- printf "%s-etcd:2379" (include "phalanx.fullname" .) }}
{{- else }}
{{- required "etcd.endpoint is required unless etcd.bundled.enabled" .Values.etcd.endpoint }}
{{- end }}
{{- end }}
